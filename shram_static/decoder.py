"""`StaticDecoder`: the static steps in PyTorch, eager or `torch.compile(fullgraph=True)`."""

import contextlib
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


# Inductor option for a compiled decode step of 2..FEW_ROWS rows: store a value read by several
# consumers (here: the n row reductions of each RowLinear) instead of recomputing it in each.
# WHY: Inductor inlines a cheap producer such as the RMSNorm into every consumer, and Inductor's
# C++ keeps libm's errno semantics (-fmath-errno), so the norm's rsqrt stays in the innermost
# loop, once per row per 8 weights. At one row the default fusion is as fast or faster
# (docs/performance.md, "Compiled torch"; "Tried and not kept").
ROW_INPUTS_STORED = {"realize_reads_threshold": 1}

# Inductor option for both compiled steps: no `assert_size_stride` calls in the generated
# Python wrapper. WHY: it re-checks, on every call, the sizes and strides of every weight and
# state tensor a step reads (each a C++ call from Python); Dynamo's
# guards check the same before every call, and a step's own inputs come from `_run` in fixed
# shapes. A public Inductor option, not a registered accelerator.
NO_SIZE_ASSERTS = {"size_asserts": False}

# Inductor option for every compiled step: the C++ compiler may contract a product and the sum
# it feeds into one fused multiply-add. WHY: Inductor builds its C++ with -ffp-contract=off
# (its `cpp.enable_floating_point_contract_flag`), so each of RowLinear's row reductions and
# each attention sum issues a multiply and a separate add per element, and the few-token steps
# are bound by those instructions once their weights sit in cache. An FMA rounds once instead
# of twice: the logits move by float rounding, as any change of summation order does
# (docs/performance.md, "Compiled torch"). A public Inductor option; empty where a torch lacks it.
FMA_CONTRACTION = ({"cpp.enable_floating_point_contract_flag": "fast"}
                   if hasattr(torch._inductor.config.cpp, "enable_floating_point_contract_flag") else {})


def owned_guards(entries) -> list[bool]:
    """Dynamo's guard filter for every compiled step (`torch.compile`'s public
    `guard_filter_fn`): keeps the guards on the step's inputs and on global state (grad mode,
    the prefix length's range), and drops those on the decoder's own model copy (its modules'
    structure, and the weights and state tensors they hold) and on module globals.

    WHY: those are about 600 checks before every call, about a tenth of the built-in model's
    decode step (docs/performance.md, "Host cost of the compiled step"). No caller's code reaches
    the decoder's copy (`shared_copy`: new modules over the caller's weights); a caller may
    change a weight's data, which the decoder follows (`StaticDecoder._follow_weights` compiles
    again where a tensor's layout changed); and each decoder's steps are code objects of its own
    (`StaticDecoder.step_function`), so no other decoder's graph can match. Public filters of
    `torch.compiler` (the `_unsafe` in their names is theirs).

    Args:
        entries: Dynamo's guard entries of one graph.

    Returns:
        one bool per entry: keep it.
    """
    mods = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    glob = torch.compiler.skip_guard_on_globals_unsafe(entries)
    return [m and g for m, g in zip(mods, glob)]


# what every compiled step is built with
STEP_OPTIONS = {**NO_SIZE_ASSERTS, **FMA_CONTRACTION, "guard_filter_fn": owned_guards}
KINDS = ("decode", "prefill", "verify", "prefill_last")  # the kinds of step (`StaticDecoder.step_function`)
# The longest prefix of the short side: a compiled kind of step is two graphs, prefixes of at
# most and of more than ACC_CHUNK slots. WHY: Inductor's C++ sums a float reduction of more than
# 4096 elements in chunks (its `need_use_acc_helper`) and guards the length on the side it
# compiled, so a single graph would recompile when the rows pass 4096 slots.
ACC_CHUNK = 4096


class StaticDecoder(HostDecoder):
    """Decodes with fixed-shape state: step functions over buffers allocated once.

    Args:
        model: a `ShramForCausalLM` (eval mode; its dtype and device are used for the state).
        batch_size: B rows.
        prefill_chunk: C tokens per prefill step (prompts are split into C-token chunks).
        compile: wrap each step in `torch.compile(fullgraph=True, dynamic=False)`; each
            compiles once, on first use (a collection of `KINDS`: only those kinds). With batch_size <= FEW_ROWS on CPU the compiled steps
            run their projections as `RowLinear` and their experts as `RowExperts` on the
            decoder's own `shared_copy` of the model (same weight tensors, and its own copy of
            each projection's weight in a packed layout and of the experts' q, k and v side by
            side, made again before a step if a weight has changed); the model passed in is
            never modified. On CPU, Inductor's check of the machine's vector ISA starts
            at once, in the background (`cpu_isa.py`).
        eos_token_id: id that ends a row in `generate`.
        verify_len: tokens per row of the verify step (`verify`: the last accepted token and
            up to verify_len - 1 guesses, speculative decoding), its own compiled function;
            None: no verify step (verification then runs as prefill). Steps of at most
            verify_len tokens per row attend per token, as the decode step does (`step.step`'s
            per_token_max); longer prefill chunks attend expert by expert. Compiled on CPU,
            a verify step of at most FEW_ROWS (8) tokens per row runs its projections as
            `RowLinear` row reductions; a longer one as matrix products, which made a 9-token
            verify step cost ~3 decode steps on the built-in model.
        rollback_limit: the most tokens a row can forget at once (`rollback`); the state is
            built for max(prefill_chunk, verify_len, rollback_limit) (see `state.py`).
        quantize: None (the model's weights), "int8" or "int4": the decoder's copy takes
            weight-only quantized linear layers (`quantized.quantize_linears_`: every
            projection and the lm_head; int8 per output channel, int4 in groups of 32 inputs),
            made once here from the model's weights (later changes to them are not followed).
            Eager and compiled; the model passed in is not modified.
        options: Inductor options added to every compiled step's own (`torch.compile`'s).

    Each step runs over the first P slots of every expert's cache, the shortest of
    `prefix_lengths` that holds every row's live slots (`state.prefix_len`), so a step's cost
    follows the rows' depth, not the capacity. `step_function(kind)` is one kind of step (decode,
    prefill, verify, prefill_last: a prompt chunk's logits at each row's last live token) at
    every length; each compiles on its first call, or ahead in `warm_up`.
    """

    def __init__(self, model, batch_size: int = 1, prefill_chunk: int = 32, compile=False,
                 eos_token_id: int | None = None, verify_len: int | None = 5,
                 rollback_limit: int | None = None, quantize: str | None = None, options: dict | None = None):
        super().__init__(model.config, batch_size, prefill_chunk, eos_token_id)
        kinds = set(KINDS) if compile is True else set(compile or ())
        if not kinds <= set(KINDS):
            raise ValueError(f"compile must be a bool or a collection of {KINDS}, got {compile!r}")
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
        # The verify step (a few tokens per row) attends per token, as the decode step does:
        # Inductor reads the gathered caches in place (exports, where a gather is a copy, do not).
        few = verify_len or 1
        decode_options = STEP_OPTIONS
        if kinds and batch_size <= FEW_ROWS and p.device.type == "cpu":
            # every compiled step on the swapped copy: decode and verify rows as row reductions,
            # a prefill chunk's projections as F.linear and its experts as one batched matmul
            # (RowExperts), the last-token head of a prompt chunk over B rows
            row_linear_(self.model)
            # int4, at one row too: its loops are bound by instructions, and the norm's rsqrt
            # inlined into each of them is measurable (docs/performance.md, "Quantization")
            if batch_size > 1 or quantize == "int4":
                decode_options = {**STEP_OPTIONS, **ROW_INPUTS_STORED}
        self.module = StepModule(self.model, self.state, per_token_max=few)
        # the RowLinears and RowExperts, whose own copies are packed again before a step once a
        # weight they are made of has changed (its version counter: written in place; its data
        # pointer: replaced)
        packers = [m for m in self.module.modules() if isinstance(m, (RowLinear, RowExperts))]
        self._row_owner = [m for m in packers for _ in m.sources]  # the packer of each weight
        self._row_weights = [w for m in packers for w in m.sources]
        self._row_stamps = _stamps(self._row_weights)
        # every tensor a step reads besides its inputs, and where each one's data starts: the
        # steps' guards skip them (`owned_guards`), so `_follow_weights` compiles again when
        # one's layout changed
        self._read = self._reads()
        self._read_ptrs = [t.data_ptr() for t in self._read]
        self._read_layouts = [_layout(t) for t in self._read]
        self.compiled = bool(kinds)
        self._compiled_kinds = kinds
        self._dynamic: set[tuple[str, bool]] = set()  # the step functions that have been called
        self._held: set[str] | None = None  # inside `steady`: the steps whose weights were checked there
        # each kind of step's Inductor options: the verify step (a few tokens per row) reads each
        # RowLinear weight once for all its rows, as a decode step of several rows does
        self._options = {k: {**o, **(options or {})} for k, o in (
            ("decode", decode_options), ("prefill", STEP_OPTIONS), ("prefill_last", STEP_OPTIONS),
            ("verify", {**STEP_OPTIONS, **ROW_INPUTS_STORED}))}
        # one compiled graph serves every length: the slot numbers are an input of dynamic size
        # (`accelerators.dynamic_length`; where it is off, compiled steps read the whole cache)
        lengths = prefix_lengths(model.config, MIN_PREFIX)
        self.prefix_lengths = lengths[-1:] if kinds and not accelerators.dynamic_length() else lengths
        self._slots = PrefixSlots(model.config, self.prefix_lengths, p.device)
        self._steps: dict[tuple[str, bool], object] = {}  # (kind, long) -> its step function
        if kinds:
            accelerators.prepare_compile(p.device.type)  # ISA check beside the first trace; batched builds

    def step_function(self, kind: str, long: bool = False):
        """The function that runs one kind of step, made on first request:
        `tokens (B, C), input_pos (B,), live (B, C), slots (P,) -> logits`, over the first P
        slots of the sparse caches (`step.step`'s slots: `slot_numbers(T)[:P]`).

        A compiled kind is a `torch.compile(fullgraph=True, dynamic=False)` function of its own
        code object, so no kind's shapes ever recompile another's; P is its one dynamic size, so
        one graph serves every length up to ACC_CHUNK, and one more every longer length. It
        compiles on its first call (or in `warm_up`).

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
            # closures of `run` (of every kind and decoder) would share one cache and recompile
            name = f"{kind}_step" + "_long" * long
            code = run.__code__.replace(co_name=name, co_qualname=name)
            run = torch.compile(types.FunctionType(code, run.__globals__, name, None, run.__closure__),
                                fullgraph=True, dynamic=False, options=self._options[kind])
        self._steps[(kind, long)] = run
        return run

    def warm_up(self, kinds=("decode", "prefill_last")) -> None:
        """Compiles (or, eager, runs) each kind of step ahead of use, on dead tokens, which
        change no state (they write only the sink rows).

        Args:
            kinds: the kinds of step (`step_function`); "verify" only with a verify step.
        """
        B, d = self.batch_size, self.device
        widths = {"decode": 1, "prefill": self.prefill_chunk, "prefill_last": self.prefill_chunk,
                  "verify": self.verify_len}
        if "verify" in kinds and self.verify_len is None:
            raise ValueError("warm_up('verify') needs a decoder built with verify_len")
        # a depth whose prefix is the shortest, and one past ACC_CHUNK slots where there is one
        depths = [0] + [self.config.block_length * ACC_CHUNK] * (self.prefix_lengths[-1] > ACC_CHUNK)
        for kind in kinds:
            C = widths.get(kind, 0)
            for depth in depths:
                info(f"warming up the {kind} step" + f" (prefixes over {ACC_CHUNK} slots)" * (depth > 0))
                self._run(torch.zeros(B, C, dtype=torch.long), torch.full((B,), depth),
                          torch.zeros(B, C, dtype=torch.bool), kind)

    def _run_last(self, tokens, input_pos, live):
        return self._run(tokens, input_pos, live, "prefill_last")

    @torch.no_grad()
    def _run(self, tokens, input_pos, live, kind: str | None = None):
        C = tokens.shape[1]
        kind = kind or ("decode" if C == 1 else "prefill" if C == self.prefill_chunk else "verify")
        # every live slot of every row fits: at most max(input_pos) + C tokens after the step
        slots = self._slots(input_pos, C)
        key = (kind, slots.shape[0] > ACC_CHUNK)
        d = self.device
        args = tokens.to(d), input_pos.to(d), live.to(d), slots
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
        return fn(*args)

    def _reads(self) -> list[torch.Tensor]:
        """The model copy's tensors (the state, the decoder's own and never replaced, aside)."""
        return [*self.model.parameters(), *self.model.buffers()]

    def _follow_weights(self) -> None:
        """Packs again the copies of every RowLinear or RowExperts one of whose weights has
        changed since they were packed (written in place, or replaced); if a tensor the steps
        read now has another shape, stride, dtype, device or alignment (the guards that would
        notice are skipped: `owned_guards`), drops the compiled steps, which compile again."""
        stamps = _stamps(self._row_weights)
        repacked = stamps != self._row_stamps
        if repacked:
            for m in {m for m, now, then in zip(self._row_owner, stamps, self._row_stamps) if now != then}:
                m.repack()
            self._row_stamps = stamps
        read = self._reads() if repacked else self._read  # a repack may make a new buffer
        ptrs = [t.data_ptr() for t in read]
        if repacked or ptrs != self._read_ptrs:
            layouts = [_layout(t) for t in read]
            if layouts != self._read_layouts:
                self._steps.clear()
                self._dynamic.clear()
                self._read_layouts = layouts
            self._read, self._read_ptrs = read, ptrs

    @contextlib.contextmanager
    def steady(self, on: bool = True):
        """Within the block (when `on`), the caller runs no code of its own user's between steps
        (`generate` without a streamer): no weight can change, so each kind of step checks the
        weights (`_follow_weights`) once, at its first call."""
        held = self._held
        self._held = set() if on else None
        try:
            yield
        finally:
            self._held = held


def _layout(t: torch.Tensor) -> tuple:
    """What a compiled step's code assumes of a tensor it reads: shape, strides, dtype, device,
    and its data's alignment to Inductor's 16 bytes."""
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0


def _stamps(weights: list) -> list:
    """Each weight's version counter and data pointer (one list: cheaper per step than a call
    per module)."""
    return [(w._version, w.data_ptr()) for w in weights]
