#!/usr/bin/env python3
"""The import graph of src/, per file and per top-level module, from `use crate::`/`use super::`
and `crate::a::b` paths in code (comments, #[cfg(test)] modules and test files left out).

Prints the cycles (strongly connected components of more than one node) at both levels, and the
arrows that point up between the rooms lib.rs lists (vocabulary, HTTP vocabulary, store, built on
the store, layers). Exits 1 when it finds any.

    python3 scripts/import_cycles.py src [-v]
"""
import os, re, sys
from collections import defaultdict

ROOT = next((a for a in sys.argv[1:] if not a.startswith('-')), 'src')

def module_of(path):
    rel = os.path.relpath(path, ROOT)[:-3]
    parts = rel.split('/')
    if parts[-1] in ('mod', 'lib'):
        parts = parts[:-1]
    return parts

files = {}
for d, _, fs in os.walk(ROOT):
    for f in fs:
        if f.endswith('.rs'):
            p = os.path.join(d, f)
            files[tuple(module_of(p))] = p

def code_of(text):
    # drop #[cfg(test)] mod blocks (by brace matching) and comments
    out, i = [], 0
    while True:
        m = re.search(r'#\[cfg\(test\)\]\s*(pub(\([a-z]+\))?\s+)?mod\s+\w+\s*\{', text[i:])
        if not m:
            out.append(text[i:]); break
        out.append(text[i:i + m.start()])
        j, depth = i + m.end(), 1
        while depth and j < len(text):
            depth += {'{': 1, '}': -1}.get(text[j], 0); j += 1
        i = j
    code = ''.join(out)
    return re.sub(r'//[^\n]*', '', code)

def resolve(mod, path):
    """the longest known module prefix of `path` (a list) seen from module `mod`"""
    if path[0] == 'crate':
        target = path[1:]
    elif path[0] == 'super':
        base = list(mod)
        while path and path[0] == 'super':
            base = base[:-1]; path = path[1:]
        target = base + path
    elif path[0] == 'self':
        target = list(mod) + path[1:]
    else:
        return None
    for n in range(len(target), 0, -1):
        if tuple(target[:n]) in files:
            return tuple(target[:n])
    return None

edges = defaultdict(set)
test_files = {k for k, p in files.items() if p.endswith('tests.rs') or '/tests/' in p or 'testing' in p or 'conformance' in p or 'fuzz' in p}
for mod, p in files.items():
    if mod in test_files:
        continue
    code = code_of(open(p).read())
    paths = []
    for m in re.finditer(r'\buse\s+((?:crate|super|self)(?:::\w+)*)(?:::\{([^;]*)\})?', code, re.S):
        head = m.group(1).split('::')
        if m.group(2):
            for item in re.split(r',\s*', m.group(2)):
                item = item.strip().split(' as ')[0]
                if not item: continue
                sub = re.split(r'::', item.split('{')[0])
                paths.append(head + [s for s in sub if s and s != 'self'])
        else:
            paths.append(head)
    for m in re.finditer(r'\b((?:crate|super)(?:::\w+)+)', code):
        paths.append(m.group(1).split('::'))
    for path in paths:
        target = resolve(mod, path)
        if target and target != mod:
            edges[mod].add(target)

def sccs(nodes, adj):
    index, low, stack, on, out, c = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)
    def visit(v):
        index[v] = low[v] = c[0]; c[0] += 1; stack.append(v); on.add(v)
        for w in adj.get(v, ()):
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v: break
            out.append(comp)
    for v in nodes:
        if v not in index: visit(v)
    return [c for c in out if len(c) > 1]

def name(m): return '/'.join(m) or 'lib'
# file level: edges between files, ignoring a child's edge to its parent mod.rs and parent->child
file_adj = defaultdict(set)
for a, bs in edges.items():
    for b in bs:
        if b == a[:len(b)] or a == b[:len(a)]:
            continue  # parent/child (mod.rs declares and re-exports its children)
        file_adj[a].add(b)
fc = sccs(list(files), file_adj)
print('file-level cycles:', len(fc))
for c in fc: print('  ', ' <-> '.join(sorted(map(name, c))))
# folder level: top-level modules
top = defaultdict(set)
for a, bs in edges.items():
    for b in bs:
        if a[:1] != b[:1] and a and b:
            top[a[0]].add(b[0])
tc = sccs(sorted({m[0] for m in files if m}), top)
print('top-level module cycles:', len(tc))
for c in tc: print('  ', ' <-> '.join(sorted(c)))

# upward arrows: the rooms of lib.rs, lowest first
RANK = {}
for rank, names in enumerate([
    'error expiring key keyspace metrics on_error pace rate task'.split(),
    'body grpc headers rejection'.split(),
    ['store'],
    'claim keepalive lock rate_client'.split(),
    'concurrency idempotency rate_limit'.split(),
]):
    for n in names: RANK[n] = rank
up = [(a, b) for a in sorted(top) for b in sorted(top[a]) if a in RANK and b in RANK and RANK[b] > RANK[a]]
print('upward arrows between rooms:', len(up))
for a, b in up: print('  ', a, '->', b)
if '-v' in sys.argv:
    for a in sorted(top): print(a, '->', ' '.join(sorted(top[a])))
sys.exit(1 if fc or tc or up else 0)
