"""`StaticDecoder`: the static steps in PyTorch, eager or `torch.compile(fullgraph=True)`."""

import contextlib
import itertools
import operator
import os
import types

import torch
import torch._inductor.config  # noqa: F401 -- read below for the FP-contraction option

from . import accelerators
# RowLinear: also importable from here, where the decoder that uses it lives
from .fast_layers import FEW_ROWS, RowExperts, RowLinear, row_linear_, shared_copy  # noqa: F401
from .console import info
from .host import HostDecoder
from .quantized import Int4Linear, Int8Linear, check_quantize, quantize_linears_
from .state import MIN_PREFIX, PrefixSlots, StaticState, prefix_lengths
from .step import StepModule
from .validation import check_verify_len


# Inductor option for a compiled step of 2..FEW_ROWS rows: store a value several consumers read. WHY:
# else the RMSNorm, its rsqrt included, is inlined into each RowLinear's innermost loop (docs/performance.md).
ROW_INPUTS_STORED = {"realize_reads_threshold": 1}

# Inductor option: no `assert_size_stride` calls in the generated wrapper. WHY: they re-check
# every weight and state tensor on every call; Dynamo's guards and `_run`'s fixed shapes suffice.
NO_SIZE_ASSERTS = {"size_asserts": False}

# Inductor option: a product and the sum it feeds may contract into one FMA. WHY: Inductor builds with
# -ffp-contract=off, and the few-token steps are bound by the multiplies and adds. Empty where torch lacks it.
FMA_CONTRACTION = ({"cpp.enable_floating_point_contract_flag": "fast"}
                   if hasattr(torch._inductor.config.cpp, "enable_floating_point_contract_flag") else {})


def owned_guards(entries) -> list[bool]:
    """Dynamo's `guard_filter_fn` for every compiled step: one bool per guard entry, False for
    those on the decoder's own model copy and on module globals. WHY: hundreds of checks per call,
    and no caller's code reaches the copy (docs/design.md, "How each backend runs the step")."""
    mods = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    glob = torch.compiler.skip_guard_on_globals_unsafe(entries)
    return [m and g for m, g in zip(mods, glob)]


STEP_OPTIONS = {**NO_SIZE_ASSERTS, **FMA_CONTRACTION, "guard_filter_fn": owned_guards}

# Inductor option added where a caller asks for the C++ wrapper: its small buffers on the stack.
# WHY: a step's wrapper otherwise allocates each of its dozens of tiny intermediates per call
# (docs/performance.md, "Host cost of the compiled step")
STACK_BUFFERS = {"aot_inductor.allow_stack_allocation": True}
KINDS = ("decode", "prefill", "verify", "prefill_last")  # the kinds of step (`StaticDecoder.step_function`)
CPP_WRAPPER_ENV = "SHRAM_STATIC_CPP_WRAPPER"  # 1: compiled decoders add {"cpp_wrapper": True} to their options
_DECODERS = itertools.count()  # each decoder's number, in the names of its steps' code objects


def cpp_wrapper_default() -> bool:
    """Whether `CPP_WRAPPER_ENV` asks compiled decoders for Inductor's C++ wrapper (unset, 0: no; 1: yes).

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get(CPP_WRAPPER_ENV, "").strip().lower()
    if value not in ("", "0", "1", "false", "true"):
        raise ValueError(f"{CPP_WRAPPER_ENV} must be 0 or 1, got {value!r}")
    return value in ("1", "true")


# A compiled kind of step is two graphs, prefixes of at most and of more than ACC_CHUNK slots. WHY: Inductor
# sums a float reduction of more than 4096 elements in chunks and guards the length on the side it compiled.
ACC_CHUNK = 4096


class StaticDecoder(HostDecoder):
    """Decodes with fixed-shape state: step functions over buffers allocated once.

    Args:
        model: a `ShramForCausalLM` (eval mode; its dtype and device are used for the state).
        batch_size: B rows.
        prefill_chunk: C tokens per prefill step (prompts are split into C-token chunks).
        compile: wrap each step in `torch.compile(fullgraph=True)` (static shapes), compiled on
            first use (a collection of `KINDS`: only those kinds). With batch_size <= FEW_ROWS
            on CPU the steps run on a `shared_copy` with `RowLinear` / `RowExperts` (the model
            passed in is never modified).
        eos_token_id: id that ends a row in `generate`.
        verify_len: tokens per row of the verify step (speculative decoding), which attends per
            token as the decode step does; None: verification runs as prefill.
        rollback_limit: the most tokens a row can forget at once; the state is built for
            max(prefill_chunk, verify_len, rollback_limit).
        quantize: None, "int8" or "int4": weight-only quantized linear layers on the decoder's
            copy (`quantized.quantize_linears_`), made once here (later weight changes are not followed).
        options: Inductor options added to every compiled step's own; with `"cpp_wrapper": True`
            (the default where `CPP_WRAPPER_ENV` is 1) the steps unroll their layers and keep small
            buffers on the stack (`STACK_BUFFERS`, unless `options` says otherwise): a cold compile
            of minutes (docs/performance.md, "Host cost of the compiled step").

    Raises:
        ValueError: a bad argument, or a bad `CPP_WRAPPER_ENV` value.
    """

    def __init__(self, model, batch_size: int = 1, prefill_chunk: int = 32, compile=False,
                 eos_token_id: int | None = None, verify_len: int | None = 5,
                 rollback_limit: int | None = None, quantize: str | None = None, options: dict | None = None):
        super().__init__(model.config, batch_size, prefill_chunk, eos_token_id)
        kinds = set(KINDS) if compile is True else set(compile or ())
        if not kinds <= set(KINDS):
            raise ValueError(f"compile must be a bool or a collection of {KINDS}, got {compile!r}")
        if kinds and cpp_wrapper_default():  # every command's compiled backends, by the environment
            options = {"cpp_wrapper": True, **(options or {})}
        check_verify_len(verify_len)
        check_quantize(quantize)
        p = next(model.parameters())
        self.device = p.device
        self.model = shared_copy(model).eval()
        self.quantize = quantize
        if quantize is not None:  # before row_linear_: it then finds no nn.Linear to swap
            quantize_linears_(self.model, quantize)
        self.state = StaticState(model.config, batch_size, prefill_chunk, dtype=p.dtype, device=p.device,
                                 rollback_limit=max(rollback_limit or 0, verify_len or 0))
        self.rollback_limit, self.verify_len = self.state.rollback_limit, verify_len
        decode_options = STEP_OPTIONS
        if kinds and batch_size <= FEW_ROWS and p.device.type == "cpu":
            row_linear_(self.model)
            if batch_size > 1:
                decode_options = {**STEP_OPTIONS, **ROW_INPUTS_STORED}
        # the verify step attends per token: Inductor reads the gathered caches in place
        cpp_wrapper = bool((options or {}).get("cpp_wrapper"))
        # WHY unrolled under the C++ wrapper: it cannot compile a nested region (invoke_subgraph) on
        # torch 2.14 and before, nor one called more than once on 2.15 (docs/upstream/pytorch.md)
        self.module = StepModule(self.model, self.state, per_token_max=verify_len or 1, nested=not cpp_wrapper)
        # the RowLinears and RowExperts, packed again before a step once one of their weights changed
        packers = [m for m in self.module.modules() if isinstance(m, (RowLinear, RowExperts))]
        self._row_owner = [m for m in packers for _ in m.sources]  # the packer of each weight
        self._row_weights = [w for m in packers for w in m.sources]
        self._row_stamps = _stamps(self._row_weights)
        # every tensor a step reads besides its inputs: the guards skip them (`owned_guards`), so
        # `_follow_weights` compiles again when one's layout changed
        read = self._reads()
        self._read_layouts = [_layout(t) for t in read]
        self._watched = self._swappable(read)
        self._watched_ptrs = list(map(torch.Tensor.data_ptr, self._watched))
        self.compiled = bool(kinds)
        self._compiled_kinds = kinds
        self._dynamic: set[tuple[str, bool]] = set()  # the step functions that have been called
        self._held: set[str] | None = None  # inside `steady`: the steps whose weights were checked there
        # the verify step reads each RowLinear weight once for all its rows, as a multi-row decode does
        self._options = {k: {**o, **(STACK_BUFFERS if cpp_wrapper else {}), **(options or {})} for k, o in (
            ("decode", decode_options), ("prefill", STEP_OPTIONS), ("prefill_last", STEP_OPTIONS),
            ("verify", {**STEP_OPTIONS, **ROW_INPUTS_STORED}))}
        # one compiled graph serves every length: the slot numbers are an input of dynamic size
        # (`accelerators.dynamic_length`; where it is off, compiled steps read the whole cache)
        lengths = prefix_lengths(model.config, MIN_PREFIX)
        self.prefix_lengths = lengths[-1:] if kinds and not accelerators.dynamic_length() else lengths
        self._slots = PrefixSlots(model.config, self.prefix_lengths, p.device)
        self._steps: dict[tuple[str, bool], object] = {}  # (kind, long) -> its step function
        self._number = next(_DECODERS)
        if kinds:
            accelerators.prepare_compile(p.device.type)  # ISA check beside the first trace; batched builds

    def step_function(self, kind: str, long: bool = False):
        """The function of one kind of step, made on first request:
        `tokens (B, C), input_pos (B,), live (B, C), slots (P,) -> logits`. A compiled kind has
        its own code object (no kind recompiles another) and P as its one dynamic size.

        Args:
            kind: "decode" (C = 1), "prefill" (C = prefill_chunk), "verify" (C = verify_len) or
                "prefill_last" (a prefill chunk, logits at each row's last live token).
            long: the function for prefixes longer than ACC_CHUNK slots.

        Returns:
            the step function.
        """
        fn = self._steps.get((kind, long))
        if fn is not None:
            return fn
        if kind not in KINDS:
            raise ValueError(f"no {kind!r} step: the kinds are {KINDS}")
        module, last_only = self.module, kind == "prefill_last"

        def run(tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
            return module(tokens, input_pos, live, last_only=last_only, slots=slots)
        if kind in self._compiled_kinds:
            # WHY a new code object: Dynamo keeps its compiled graphs per code object, so the
            # closures of `run` (of every kind and decoder) would share one cache and recompile.
            # WHY the decoder's number in its name: Dynamo's automatic dynamic shapes remember the
            # values seen by a code object's (file, line, name), so a later decoder of another
            # config would compile that config's sizes as symbols (on torch 2.15 its nested layer
            # region then fails to trace)
            name = f"{kind}_step" + "_long" * long + f"_{self._number}"
            code = run.__code__.replace(co_name=name, co_qualname=name)
            # WHY `dynamic` unset: every shape is static by default (the slots' length is marked
            # dynamic by itself), and `dynamic=False` patches Dynamo's config around every call
            run = torch.compile(types.FunctionType(code, run.__globals__, name, None, run.__closure__),
                                fullgraph=True, options=self._options[kind])
        self._steps[(kind, long)] = run
        return run

    def warm_up(self, kinds=("decode", "prefill_last")) -> None:
        """Compiles (or, eager, runs) each kind of step ahead of use, on dead tokens (no state changes).

        Args:
            kinds: the kinds of step (`step_function`); "verify" only with a verify step.
        """
        if "verify" in kinds and self.verify_len is None:
            raise ValueError("warm_up('verify') needs a decoder built with verify_len")
        B, widths = self.batch_size, self._warm_up_widths(kinds)
        # a depth whose prefix is the shortest, and one past ACC_CHUNK slots where there is one
        depths = [0] + [self.config.block_length * ACC_CHUNK] * (self.prefix_lengths[-1] > ACC_CHUNK)
        for kind in kinds:
            C = widths[kind]
            # a cold compile under the C++ wrapper takes minutes (the layers unrolled): say so while it runs
            slow = kind in self._compiled_kinds and self._options[kind].get("cpp_wrapper")
            for depth in depths:
                info(f"warming up the {kind} step" + f" (prefixes over {ACC_CHUNK} slots)" * (depth > 0)
                     + " under Inductor's C++ wrapper: minutes the first time, then from Inductor's cache" * bool(slow))
                self._run(torch.zeros(B, C, dtype=torch.long), torch.full((B,), depth),
                          torch.zeros(B, C, dtype=torch.bool), kind)

    def _step_widths(self) -> dict[str, int]:
        return {"decode": 1, "prefill": self.prefill_chunk, "prefill_last": self.prefill_chunk,
                **({"verify": self.verify_len} if self.verify_len else {})}

    def _run_last(self, tokens, input_pos, live):
        return self._run(tokens, input_pos, live, "prefill_last")

    @torch.no_grad()
    def _run(self, tokens, input_pos, live, kind: str | None = None):
        C = tokens.shape[1]
        kind = kind or ("decode" if C == 1 else "prefill" if C == self.prefill_chunk else "verify")
        slots = self._slots(input_pos, C)
        key = (kind, slots.shape[0] > ACC_CHUNK)
        # every kind of a compiled decoder's steps, eager ones too, reads the packed copies
        if self.compiled and (self._held is None or kind not in self._held):
            self._follow_weights()  # first: it may drop the compiled steps
            if self._held is not None:
                self._held.add(kind)
        fn = self._steps.get(key) or self.step_function(*key)
        if kind in self._compiled_kinds and key not in self._dynamic:  # its first call compiles: P dynamic
            if len(self.prefix_lengths) > 1:
                accelerators.dynamic_length(slots)
            self._dynamic.add(key)
        if self.device.type != "cpu":  # WHY only then: each `.to` is a dispatched op, a no-op on the CPU
            tokens, input_pos, live = tokens.to(self.device), input_pos.to(self.device), live.to(self.device)
        return fn(tokens, input_pos, live, slots)

    def _reads(self) -> list[torch.Tensor]:
        """The model copy's tensors (the state, never replaced, aside)."""
        return [*self.model.parameters(), *self.model.buffers()]

    def _swappable(self, read: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors of `read` a caller can replace (`.data =`, `set_`) that no stamp covers:
        not the row weights (`_stamps`), nor the packed copies (only a repack replaces them).
        WHY: each tensor checked costs a cache miss on every call right after a step."""
        packed = (b for m in set(self._row_owner) for b in m.buffers(recurse=False))
        skip = {id(t) for t in (*packed, *self._row_weights)}
        return [t for t in read if id(t) not in skip]

    def _follow_weights(self) -> None:
        """Repacks the RowLinears / RowExperts whose weights changed; drops the compiled steps
        if a tensor they read changed layout (the guards that would notice are skipped)."""
        stamps = _stamps(self._row_weights)
        repacked = stamps != self._row_stamps
        if repacked:
            for m in {m for m, now, then in zip(self._row_owner, stamps, self._row_stamps) if now != then}:
                m.repack()
            self._row_stamps = stamps
        ptrs = list(map(torch.Tensor.data_ptr, self._watched))
        if repacked or ptrs != self._watched_ptrs:
            read = self._reads()  # a repack may make a new buffer
            layouts = [_layout(t) for t in read]
            if layouts != self._read_layouts:
                self._steps.clear()
                self._dynamic.clear()
                self._read_layouts = layouts
            self._watched = self._swappable(read)
            self._watched_ptrs = list(map(torch.Tensor.data_ptr, self._watched))

    @contextlib.contextmanager
    def steady(self, on: bool = True):
        """Within the block (when `on`), the caller runs none of its user's code between steps,
        so each kind of step checks the weights (`_follow_weights`) once, at its first call."""
        held = self._held
        self._held = set() if on else None
        try:
            yield
        finally:
            self._held = held


def _layout(t: torch.Tensor) -> tuple:
    """What a compiled step assumes of a tensor: shape, strides, dtype, device, 16-byte alignment."""
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0


_VERSION = operator.attrgetter("_version")


def _stamps(weights: list) -> list:
    """Each weight's version counter and data pointer."""
    return list(zip(map(_VERSION, weights), map(torch.Tensor.data_ptr, weights)))
