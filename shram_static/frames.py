"""A compiled step's frame code, called without Dynamo's per-call lookup.

`torch.compile` replaces a function's frame: on every call Dynamo's frame evaluation looks up
the function's cache entries, checks the matching entry's guards and runs the entry's
transformed bytecode, which calls the compiled graph. `StaticDecoder(skip_guards=True)` already
skips the guards once a step has run with them checked (`set_stance(skip_guard_eval_unsafe=True)`,
for as long as every weight and state tensor is the one they were checked with). Even so, the
lookup under that stance costs 70-100 us per call on the built-in model's 0.28 ms decode step
and 0.5-0.8 ms on the bench model's ~9 ms step (`docs/performance.md`, "Compiled torch").
`DirectFrame` calls the entry's transformed bytecode itself, under the same condition.

Registered as the accelerator `direct_frame` (shram_static/accelerators.py): with another torch
than it was verified on, or with `SHRAM_STATIC_STOCK=1`, the decoder keeps the stance above.
"""

import types

import torch


class DirectFrame:
    """The transformed code of the cache entry that served a compiled function's last call,
    callable as the function is. Made by `DirectFrame.of`.

    Args:
        func: the plain function behind the compiled one; bound: the instance of a compiled
            bound method (None for a function); entry_code: the cache entry's transformed code;
            entries: Dynamo's listing of a code object's cache entries.
    """

    def __init__(self, func: types.FunctionType, bound, entry_code: types.CodeType, entries):
        self._code = func.__code__
        self._entries = entries  # Dynamo's listing of a code object's cache entries
        self._entry_code = entry_code
        self._bound = bound  # the method's instance, passed as the frame's first argument
        self._run = types.FunctionType(entry_code, func.__globals__, func.__name__, func.__defaults__,
                                       func.__closure__)

    @classmethod
    def of(cls, compiled) -> "DirectFrame | None":
        """The frame code that served `compiled`'s last call.

        Args:
            compiled: a `torch.compile`d function or bound method, just called with its guards
                checked (Dynamo moves the entry that served a call to the front of the
                function's cache entries, and puts a new entry there).

        Returns:
            A `DirectFrame`, or None: no plain function behind it, no cache entry, or other
            Dynamo internals than this was written for.
        """
        try:
            from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
            orig = compiled._torchdynamo_orig_callable
            func = getattr(orig, "__func__", orig)
            entries = _debug_get_cache_entry_list(func.__code__)
            if not entries or not isinstance(func, types.FunctionType):
                return None
            entry_code = entries[0].code
            if not isinstance(entry_code, types.CodeType) or entry_code.co_freevars != func.__code__.co_freevars:
                return None
            return cls(func, getattr(orig, "__self__", None), entry_code, _debug_get_cache_entry_list)
        except Exception:  # noqa: BLE001 (another torch: the decoder keeps Dynamo's lookup)
            return None

    def usable(self) -> bool:
        """Whether Dynamo would run this code now: its entry is still cached (no
        `torch._dynamo.reset()` since), Dynamo is on and the stance compiles as usual (not
        `force_eager`, no `force_backend`)."""
        cur = getattr(torch._dynamo.eval_frame, "_stance", None)
        if cur is None or cur.stance == "force_eager" or cur.backend is not None or torch._dynamo.config.disable:
            return False
        return any(e.code is self._entry_code for e in self._entries(self._code))

    def __call__(self, *args):
        """Runs the frame: the compiled graph on these arguments, without guards or lookup."""
        if self._bound is not None:
            return self._run(self._bound, *args)
        return self._run(*args)
