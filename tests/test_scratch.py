"""Scratch buffers hoisted out of Inductor's Python wrapper (shram_static/scratch.py).

A wrapper written the way Inductor writes one checks the rewrite's rules (what may be made
once, what must stay fresh); the real compiled step checks that it is rewritten, that a step's
logits survive the next step, that two threads sharing one rewritten module get what each would
alone, and that the stock path (another process) gives the same logits bit for bit.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from helpers import compiled_test_model

from shram_static import StaticDecoder, scratch
from shram_static.accelerators import STOCK_ENV, enabled

pytestmark = pytest.mark.skipif(not enabled("persistent_scratch"),
                                reason="accelerator persistent_scratch is off here (release or switch)")

TOL = 2e-4

WRAPPER = '''
import torch
empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
s0 = 4

def kernel(x, out, k=1.0):
    out.copy_(x.reshape(out.shape) * k)

def sub(args):
    a, = args
    args.clear()
    t = empty_strided_cpu((4, ), (1, ), torch.float32)      # scratch: made once
    kernel(a, t, 2.0)
    r = empty_strided_cpu((4, ), (1, ), torch.float32)      # returned: fresh
    kernel(t, r)
    return (r, a)                                            # a: its caller's buffer

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def call(self, args):
        x, = args
        args.clear()
        buf0 = empty_strided_cpu((4, ), (1, ), torch.float32)   # scratch
        buf1 = reinterpret_tensor(buf0, (2, 2), (2, 1), 0)      # view of scratch: made once
        kernel(x, buf1)
        kernel(x, reinterpret_tensor(buf0, (2, 2), (2, 1), 0))  # a view in the arguments: made once
        buf2 = empty_strided_cpu((4, ), (1, ), torch.float32)   # passed to sub, which returns it
        kernel(buf0, buf2)
        out = sub([buf2])
        buf3 = out[1]
        buf4 = empty_strided_cpu((4, ), (1, ), torch.float32)   # returned through a view
        buf5 = reinterpret_tensor(buf4, (2, 2), (2, 1), 0)
        kernel(out[0], buf5)
        buf6 = empty_strided_cpu((4, ), (1, ), torch.float32)   # returned through a reuse
        buf7 = buf6; del buf6  # reuse
        kernel(buf3, buf7)
        buf8 = empty_strided_cpu((s0, ), (1, ), torch.float32)  # a symbolic size: not literal
        kernel(x, buf8)
        keep = []
        buf9 = empty_strided_cpu((4, ), (1, ), torch.float32)   # escapes through a list
        kernel(x, buf9)
        keep.append(buf9)
        buf10 = empty_strided_cpu((4, ), (1, ), torch.float32)  # assigned twice: left alone
        buf10 = empty_strided_cpu((4, ), (1, ), torch.float32)
        kernel(buf8, buf10)
        return (buf5, buf7, buf3, keep, buf10)

call = Runner([]).call
'''


def _load(tmp_path, name):
    path = tmp_path / f"{name}.py"
    path.write_text(WRAPPER)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rewrite_keeps_returned_buffers_fresh_and_values_equal(tmp_path):
    """Only scratch nothing returned derives from is made once: `sub`'s `t`, `call`'s `buf0`
    and its views (`buf1`, and one written as a kernel's argument). Returned buffers, their bases (view, reuse, a buffer passed to a
    subgraph that returns it, a list), symbolic sizes and reassigned names stay as written; the
    values equal the unrewritten module's, call after call."""
    ref, mod = _load(tmp_path, "wrapper_ref"), _load(tmp_path, "wrapper_new")
    assert scratch.hoist_scratch(mod) == 4
    assert scratch.hoist_scratch(mod) == 0  # once per module
    assert "_shram_scratch_lock" in mod.Runner.call.__code__.co_names
    outs = []
    for seed in range(3):
        x = torch.randn(4, generator=torch.Generator().manual_seed(seed))
        want, got = ref.call([x]), mod.call([x])
        outs.append(got)
        for w, g in zip(want[:3] + (want[3][0], want[4]), got[:3] + (got[3][0], got[4])):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    ptrs = [[o[0].data_ptr(), o[1].data_ptr(), o[2].data_ptr(), o[3][0].data_ptr()] for o in outs[:2]]
    assert all(a != b for a, b in zip(*ptrs))  # returned buffers are new each call
    s = {k for k in vars(mod) if k.startswith("_shram_scratch_")}
    assert s == {"_shram_scratch_sub_t", "_shram_scratch_call_buf0", "_shram_scratch_call_buf1",
                 "_shram_scratch_call_view0", "_shram_scratch_done", "_shram_scratch_lock"}


def test_rewrite_leaves_a_module_without_source_alone():
    """A module whose source cannot be read is left as it is (the stock path)."""
    mod = type(sys)("no_source")
    exec("def call(args):\n    return args\n", mod.__dict__)
    code = mod.call.__code__
    assert scratch.hoist_scratch(mod) == 0 and mod.call.__code__ is code


def _steps(dec, ids):
    """Prefill, decode, verify, a rollback, decode: the logits of each step, kept."""
    out = [dec.prefill(ids[:, :6])]
    out += [dec.decode(ids[:, t]) for t in range(6, 9)]
    out.append(dec.verify(ids[:, 9:14]))
    dec.rollback(2)
    out += [dec.decode(ids[:, t]) for t in range(12, 14)]
    return out


def test_compiled_steps_are_rewritten_and_logits_survive_the_next_step():
    """The compiled steps' wrapper modules are rewritten; every step's logits, kept while later
    steps run, still equal the uncached forward's (scratch reused by a later step would
    overwrite them)."""
    from torch._inductor.codecache import PyCodeCache
    model = compiled_test_model(11)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    # An earlier test in this process may have loaded these steps' modules already (they are
    # shared by every compile of the same graph, and xdist runs files on a worker in any order):
    # forget the compiled frames and the loaded modules, so the steps below load theirs anew.
    torch._dynamo.reset()
    PyCodeCache.cache_clear()
    n = len(PyCodeCache.modules)
    dec = StaticDecoder(model, compile=True)
    out = _steps(dec, ids)
    mods = [m for m in PyCodeCache.modules[n:] if getattr(m, "_shram_scratch_done", False)]
    assert mods and any(k.startswith("_shram_scratch_call_") for m in mods for k in vars(m))
    with torch.no_grad():
        full = model(ids[:, :14]).logits
        rolled = model(torch.cat([ids[:, :12], ids[:, 12:14]], 1)).logits
    want = [full[:, :6]] + [full[:, t] for t in range(6, 9)] + [full[:, 9:14]] + [rolled[:, t] for t in (12, 13)]
    for g, w in zip(out, want):
        torch.testing.assert_close(g.reshape(w.shape), w, atol=TOL, rtol=0)


def test_two_threads_sharing_a_rewritten_step_get_what_each_gets_alone():
    """Two decoders of one model share the rewritten module (one graph); run in two threads at
    once, each gets the logits it gets alone (the module's lock keeps their scratch apart)."""
    model = compiled_test_model(12)
    ids = [torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(s))
           for s in (4, 5)]
    decs = [StaticDecoder(model, compile=True) for _ in ids]
    alone = [_steps(d, i) for d, i in zip(decs, ids)]
    got = [None, None]

    def work(k):
        runs = []
        for _ in range(10):
            decs[k].reset()
            runs.append(torch.stack(_steps(decs[k], ids[k])[1:4]))
        got[k] = runs

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=300) for t in threads]
    for k in (0, 1):
        assert got[k] is not None, "thread failed"
        for run in got[k]:
            torch.testing.assert_close(run, torch.stack(alone[k][1:4]), atol=0, rtol=0)


STOCK_SCRIPT = textwrap.dedent('''
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    from helpers import compiled_test_model
    from shram_static import StaticDecoder
    from torch._inductor.codecache import PyCodeCache
    # one thread, as in the tests' own processes (conftest.py): Inductor compiles for the thread
    # count, so the steps compiled by the tests above are the ones loaded here, from its cache
    torch.set_num_threads(1)
    model = compiled_test_model(13)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(6))
    dec = StaticDecoder(model, compile=True)
    out = [dec.prefill(ids[:, :6])] + [dec.decode(ids[:, t]) for t in range(6, 9)] + [dec.verify(ids[:, 9:14])]
    print(json.dumps({{"logits": [o.flatten().tolist() for o in out],
                      "rewritten": sum(getattr(m, "_shram_scratch_done", False) for m in PyCodeCache.modules)}}))
''')


def test_stock_and_rewritten_steps_give_the_same_logits():
    """The same steps with the rewrite off (`SHRAM_STATIC_STOCK=persistent_scratch`) and on,
    each in a process of its own, give bit-identical logits: the rewrite changes where scratch
    lives, not a kernel."""
    code = STOCK_SCRIPT.format(tests=os.path.dirname(__file__))
    got = {}
    for stock in (True, False):  # Inductor's cache, as the tests before: the same code in both
        env = dict(os.environ)
        env.pop(STOCK_ENV, None)
        if stock:
            env[STOCK_ENV] = "persistent_scratch"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        got[stock] = json.loads(r.stdout.strip().splitlines()[-1])
    assert got[True]["rewritten"] == 0 and got[False]["rewritten"] > 0
    assert got[True]["logits"] == got[False]["logits"]
