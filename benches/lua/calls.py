"""The calls of `cost.sh`, in Redis' wire format on stdout: SCRIPT LOAD of the script, then
CALLS calls of rate.lua, each with BATCH checks of cost 1 by random callers ($CALLERS, default
10,000) under one limit of the algorithm, as a copy sends them under load. With `--reference`,
the calls of `reference.sh` (see there): CALLS calls of MODE, callers drawn from SEED.

    [CALLERS=n] python3 calls.py SCRIPT gcra|counter|log CALLS BATCH
    python3 calls.py --reference fixed-window|empty|time|get-psetex CALLS SEED
"""
import os, sys, random, hashlib
out = sys.stdout.buffer
def cmd(*args):
    parts = [b'*%d\r\n' % len(args)]
    for a in args:
        if isinstance(a, str): a = a.encode()
        parts.append(b'$%d\r\n%s\r\n' % (len(a), a))
    out.write(b''.join(parts))

def reference(mode, n, seed):
    random.seed(seed)
    if mode == 'fixed-window':
        # tower-rate-limiter's script
        script = ("local count = redis.call('INCR', KEYS[1])\nif count == 1 then\n"
                  "    redis.call('PEXPIRE', KEYS[1], ARGV[1])\nend\n"
                  "return {count, redis.call('PTTL', KEYS[1])}\n")
        sha = hashlib.sha1(script.encode()).hexdigest()
        cmd('SCRIPT', 'LOAD', script)
        for _ in range(n):
            cmd('EVALSHA', sha, '1', 'rl:api:%d' % random.randrange(10000), '60000')
        return
    body = {'empty': "return 1",
            'time': "redis.call('TIME') return 1",
            'get-psetex': "redis.call('TIME') redis.call('GET', keys[2]) "
                          "redis.call('PSETEX', keys[1], 60000, '1') return 1"}[mode]
    cmd('FUNCTION', 'LOAD', 'REPLACE',
        '#!lua name=reference\nredis.register_function("f", function(keys, args) %s end)' % body)
    # the keys and arguments of a rate call of one check
    for i in range(n):
        cmd('FCALL', 'f', '2', 'tollgate:rl:{r%d}:charged:%016x' % (seed * n + i, i),
            'tollgate:rl:{k%d}:api:counter' % random.randrange(10000), '4102444800000000', '1',
            '500', '1', '2', '1', '1000000000', '60000000', '1', '1', '%016x' % i)

if sys.argv[1] == '--reference':
    reference(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    sys.exit()
script = open(sys.argv[1], 'rb').read()
algo = sys.argv[2]  # gcra|counter|log
calls = int(sys.argv[3]); batch = int(sys.argv[4])
callers = int(os.environ.get('CALLERS', '10000'))
sha = hashlib.sha1(script).hexdigest()
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
