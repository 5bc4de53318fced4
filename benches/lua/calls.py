"""The calls of `cost.sh`, in Redis' wire format on stdout: SCRIPT LOAD of the script, then
CALLS calls of rate.lua, each with BATCH checks of cost 1 by random callers ($CALLERS, default
10,000) under one limit of the algorithm, as a copy sends them under load.

    [CALLERS=n] python3 calls.py SCRIPT gcra|counter|log CALLS BATCH
"""
import os, sys, random, hashlib
script = open(sys.argv[1], 'rb').read()
algo = sys.argv[2]  # gcra|counter|log
calls = int(sys.argv[3]); batch = int(sys.argv[4])
callers = int(os.environ.get('CALLERS', '10000'))
sha = hashlib.sha1(script).hexdigest()
out = sys.stdout.buffer
def cmd(*args):
    parts = [b'*%d\r\n' % len(args)]
    for a in args:
        if isinstance(a, str): a = a.encode()
        parts.append(b'$%d\r\n%s\r\n' % (len(a), a))
    out.write(b''.join(parts))
library = os.environ.get('LIBRARY')  # FCALL the library of this name instead
if library:
    cmd('FUNCTION', 'LOAD', 'REPLACE', b'#!lua name=%s\nlocal library_name = %s ' % (library.encode(), repr(library).encode()) + script)
else:
    cmd('SCRIPT', 'LOAD', script)
random.seed(7)
pol = {'gcra': ['3','1','65535','65535000000'], 'counter': ['2','1','1000000000','60000000'], 'log': ['1','1','100000','60000000']}[algo]
n = 0
for c in range(calls):
    keys = ['tollgate:rl:{r%d}:charged:%016x' % (c, c)]
    argv = ['4102444800000000', '1', '500', '1'] + pol
    for b in range(batch):
        k = random.randrange(callers)
        keys.append('tollgate:rl:{k%d}:api:%s' % (k, algo))
        n += 1
        argv += ['1', '1', '%016x' % n]
    if library:
        cmd('FCALL', library, str(len(keys)), *keys, *argv)
    else:
        cmd('EVALSHA', sha, str(len(keys)), *keys, *argv)
