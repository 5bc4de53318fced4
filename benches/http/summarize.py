#!/usr/bin/env python3
"""Summarize runs.csv from run.sh into markdown tables (medians over rounds).

1. per server: req/s, ratio to the baseline `limited` (per round: req/s of the server / req/s of
   `limited` in the same round), latency, errors, CPU and Redis calls;
2. pairs: tollgate against what it replaces (same algorithm family where one exists): the ratio
   a / b of req/s (median of the per-round ratios), of CPU µs per request in the server and in
   Redis, and of Redis calls and EVALSHA per request (medians over rounds)."""
import csv, os, statistics, sys
from collections import OrderedDict

BASE = "limited"
PAIRS = [  # (a, b, why)
    ("tollgate_gcra", "trl_redis", "GCRA in Lua"),
    ("tollgate_counter", "trl", "window counter in Lua (sliding vs fixed)"),
    ("tollgate_log", "limited", "sliding log in Lua"),
    ("app", "limited", "the example app (sliding log)"),
    ("tollgate_lease", "plain", "leased quota against no limiter (the ceiling)"),
    ("tollgate_lease", "tollgate_gcra", "leased quota against a check per request"),
    ("tollgate_lease", "trl_redis", "leased quota against GCRA in Lua"),
    ("tollgate_lease", "trl", "leased quota against a window counter in Lua"),
    ("tollgate_lease", "limited", "leased quota against the hand-written sliding log"),
    ("app_lease", "app", "the example app, leased against per request"),
]

def ms(v):
    v = v.strip()
    for suf, f in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if v.endswith(suf):
            return float(v[: -len(suf)]) * f
    return float("nan")

rows = list(csv.DictReader(open(sys.argv[1])))
if not rows:
    sys.exit("no runs in " + sys.argv[1])
by = OrderedDict()
for r in rows:
    by.setdefault(r["label"], []).append(r)
med = statistics.median

def per_req(rs, key, scale=1.0):
    """median over rounds of rs[key] per request."""
    return med([float(r[key]) * scale / int(r["requests"]) for r in rs])

def rps_ratios(a, b):
    """req/s of a / req/s of b, one per round that ran both."""
    rb = {r["round"]: float(r["rps"]) for r in by.get(b, [])}
    return [float(r["rps"]) / rb[r["round"]] for r in by.get(a, []) if r["round"] in rb]

print("| server | req/s (median) | min–max | ratio to limited (median; per round) | p50 ms | p99 ms | non-2xx (all runs) | socket errs | CPU s server/redis/wrk/other | CPU µs/req server/redis | redis calls/req (EVALSHA/req) |")
print("|---|---:|---|---|---:|---:|---:|---:|---|---|---|")
for label, rs in by.items():
    rps = [float(r["rps"]) for r in rs]
    ratios = rps_ratios(label, BASE)
    p50 = med([ms(r["p50"]) for r in rs]); p99 = med([ms(r["p99"]) for r in rs])
    non2xx = sum(int(r["non2xx"]) for r in rs); serr = sum(int(r["sock_err"]) for r in rs)
    cpu = "/".join(f'{med([float(r[k]) for r in rs]):.1f}' for k in ("server_cpu_s", "redis_cpu_s", "wrk_cpu_s", "other_cpu_s"))
    calls = per_req(rs, "redis_cmds"); ev = per_req(rs, "evalsha")
    us = "/".join(f'{per_req(rs, k, 1e6):.1f}' for k in ("server_cpu_s", "redis_cpu_s"))
    ratio = f'{med(ratios):.2f} ({", ".join(f"{x:.2f}" for x in ratios)})' if ratios else "n/a"
    print(f"| {label} | {med(rps):,.0f} | {min(rps):,.0f}–{max(rps):,.0f} | {ratio} | {p50:.2f} | {p99:.2f} | {non2xx} | {serr} | {cpu} | {us} | {calls:.2f} ({ev:.2f}) |")

pairs = [(a, b, why) for a, b, why in PAIRS if a in by and b in by]
if pairs:
    def cell(a, b, key, scale=1.0, fmt="{:.1f}"):
        x, y = per_req(by[a], key, scale), per_req(by[b], key, scale)
        q = f"{x / y:.2f}" if y else "n/a"
        return f"{fmt.format(x)} / {fmt.format(y)} = {q}"
    print("\npairs (a / b; req/s: median of the per-round ratios, the rest: ratio of the medians over rounds):\n")
    print("| a / b | what | req/s ratio (per round) | server CPU µs/req | Redis CPU µs/req | Redis calls/req | EVALSHA/req |")
    print("|---|---|---|---|---|---|---|")
    for a, b, why in pairs:
        rr = rps_ratios(a, b)
        ratio = f'{med(rr):.2f} ({", ".join(f"{x:.2f}" for x in rr)})' if rr else "n/a"
        print(f"| {a} / {b} | {why} | {ratio} | {cell(a, b, 'server_cpu_s', 1e6)} | {cell(a, b, 'redis_cpu_s', 1e6)} "
              f"| {cell(a, b, 'redis_cmds', fmt='{:.2f}')} | {cell(a, b, 'evalsha', fmt='{:.2f}')} |")

loads = [float(r["load1"]) for r in rows]
msg = f"\n{len(rows)} runs kept; 1-min load average at the start of each measured run: {min(loads):.2f}–{max(loads):.2f}"
msg += f"; CPU used by other processes during a kept run: {min(float(r['other_cpu_s']) for r in rows):.2f}–{max(float(r['other_cpu_s']) for r in rows):.2f} s"
disc = os.path.join(os.path.dirname(sys.argv[1]), "discarded.csv")
if os.path.exists(disc):
    n = sum(1 for _ in open(disc)) - 1
    msg += f"; {n} run(s) discarded and repeated for foreign CPU load"
msg += f"; waited for a quiet box {sum(int(r['waited_s']) for r in rows)} s in all (kept runs)"
print(msg + ".")
bad = [f"{l} ({sum(int(r['non2xx']) for r in rs)} non-2xx, {sum(int(r['sock_err']) for r in rs)} socket errors)"
       for l, rs in by.items() if any(int(r["non2xx"]) or int(r["sock_err"]) for r in rs)]
if bad:
    print("!! not every request succeeded: " + ", ".join(bad) + " — compare those servers with care.")
