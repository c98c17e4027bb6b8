"""ExecuTorch export (`.pte`, XNNPACK) of the static steps (`export_pte`); `pte_runtime.py` runs it.

One program holds:
  * the decode step: `forward(tokens [1, 1] int64, input_pos [1] int64) -> logits [1, V]` when
    batch_size is 1 (the signature of ExecuTorch's stock `TextLLMRunner`), otherwise
    `decode(tokens [B, 1], input_pos [B], live [B, 1] bool) -> logits [B, V]`;
  * `prefill(tokens [B, C], input_pos [B], live [B, C] bool) -> logits [B, 1, V]` at each
    row's last live token (`[B, C, V]`, every token's, with `full_logits=True`), unless
    exported with `prefill_chunk=None` (decode only: prompts then run token by token through
    the decode step, as the stock runner does with any program whose `enable_dynamic_shape`
    is False; half the lowering work and a smaller file, slower prompts);
  * constant methods read by the stock runner (`get_max_seq_len`, `get_max_context_len`,
    `use_kv_cache`, `enable_dynamic_shape`, `get_eos_ids`), by optimum-executorch's
    `ExecuTorchModelForCausalLM` (also `get_bos_id`, `get_vocab_size`, `get_max_batch_size`,
    `get_dtype`) and by `load_pte`
    (`get_shram_config`: the model config JSON; `get_shram_export`: batch size, chunk,
    quantization, state names, method names, prefix lengths, as JSON).
Every step method but `forward` also takes `slots [P] float32`, the numbers of the first P
slots of each expert's sparse cache it attends (`step.step`), P a bounded dynamic size; the
runner picks P per step from the export's prefix lengths (`common.export_prefix_lengths`). At
batch 1 with `prefix_decode` it also holds `decode(tokens [1, 1], input_pos [1], live [1, 1],
slots)`, the decode step `load_pte` then runs (`forward`, for stock runners, attends the whole
cache).
Both step methods share one set of mutable state buffers. Every piece of bookkeeping is
derived from `input_pos`, so a call at position 0 starts a fresh sequence without clearing
anything (what the stock runner's `reset()` relies on).
"""

import functools
import json
import os

import torch
from torch import nn

from .. import accelerators
from ..config import ShramConfig
from ..console import without_leafspec_notice, without_mutable_buffer_notice
from ..errors import ExportFormatError  # noqa: F401 (importable from here too)
from ..state import StaticState, slot_numbers
from ..step import StepModule
from .common import PTE_FORMAT, check_export_args, export_copy, export_prefix_lengths
from .partition import xnnpack_partitioner
from .quantize import QUANTIZE_MODES, quantize_weights_
from .views import state_view_planning, written_cache_views_pass

_SCALAR_TYPE = {torch.float32: 6, torch.float16: 5, torch.bfloat16: 15}  # c10::ScalarType codes

class _Decode1(nn.Module):
    """Stock-runner decode step for batch 1: `(tokens [1, 1], input_pos [1]) -> logits [1, V]`."""

    def __init__(self, step: StepModule):
        super().__init__()
        self.step = step  # same attribute name in every wrapper, so buffer FQNs match

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        live = torch.ones_like(tokens, dtype=torch.bool)
        return self.step(tokens, input_pos, live)[:, -1, :]


class _Chunk(nn.Module):
    """Batched step with live flags: `(tokens [B, C], input_pos [B], live [B, C][, slots [P]])`
    -> logits `[B, C, V]` (verify, full-logits prefill), `[B, 1, V]` at each row's last live
    token with `last_live=True` (prefill), or `[B, V]` with `last=True` (the batched decode
    method, C = 1); over the first P sparse slots of each expert's cache with `slots`
    (`step.step`), else the whole cache."""

    def __init__(self, step: StepModule, last: bool, last_live: bool = False):
        super().__init__()
        self.step = step
        self.last = last
        self.last_live = last_live

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.step(tokens, input_pos, live, last_only=self.last_live, slots=slots)
        return logits[:, -1, :] if self.last else logits


def _init_first_method_pass(names):
    """A pass that marks the state buffers of the FIRST method it sees as initialised
    (`meta["et_init_buffer"]` on their placeholders, what ExecuTorch's
    `InitializedMutableBufferPass` sets).

    WHY: without the mark a mutated buffer is emitted with shape and dtype only, and a fresh
    program's state is whatever the allocator left (a NaN in a masked slot still poisons
    attention: 0 * NaN). With it, the starting bytes are stored per method, so marking both
    methods stores the whole state twice. The runtime copies them in when the method is loaded,
    so the decode method (lowered first, loaded first by `load_pte` and the only one the stock
    runner loads) is enough. The mark is set on the placeholders directly: ExecuTorch's pass
    sets it while re-tracing the whole graph (seconds per method), and
    `to_executorch` re-traces right after it anyway (SpecPropPass).
    """
    from torch.fx.passes.infra.pass_base import PassResult

    # Placeholder names are the FQNs with dots as underscores ("b_step_state_layers_0_taken");
    # matched as substrings, as ExecuTorch's pass does, and "..._layers_1_taken" is no substring
    # of "..._layers_11_taken".
    patterns = [f"state_{n.replace('.', '_')}" for n in names]
    calls = []

    def mark_first_method(graph_module):
        calls.append(None)
        if len(calls) == 1:
            for node in graph_module.graph.nodes:
                if node.op == "placeholder" and any(p in node.name for p in patterns):
                    node.meta["et_init_buffer"] = True
        return PassResult(graph_module, len(calls) == 1)

    return mark_first_method


def lower_program(model, batch_size: int = 1, prefill_chunk: int | None = 32, quantize: str | None = None,
                  eos_token_id: int | None = None, bos_token_id: int | None = None, *,
                  quantize_embedding: bool = False, parallel: bool = True, verify_len: int | None = None,
                  full_logits: bool = False, prefix_lengths=None, prefix_decode: bool = False):
    """Exports and lowers the two steps (with `parallel`, the decode step in a forked process);
    returns the `ExecutorchProgramManager` (not written).

    Args: as `export_pte`.

    Returns:
        The program manager; `.buffer` is the .pte bytes.
    """
    cfg: ShramConfig = model.config
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
    if not isinstance(quantize_embedding, bool):
        raise TypeError(f"quantize_embedding must be a bool, got {quantize_embedding!r}")
    if quantize_embedding and quantize is None:
        raise ValueError("quantize_embedding applies with quantize='int8' or '8da4w'")
    eos_token_id = getattr(cfg, "eos_token_id", None) if eos_token_id is None else eos_token_id
    bos_token_id = getattr(cfg, "bos_token_id", None) if bos_token_id is None else bos_token_id
    check_export_args(cfg, batch_size, 1 if prefill_chunk is None else prefill_chunk, eos_token_id,
                      bos_token_id, parallel=parallel, full_logits=full_logits, verify_len=verify_len)
    lengths = export_prefix_lengths(cfg, prefix_lengths)
    if not isinstance(prefix_decode, bool):
        raise TypeError(f"prefix_decode must be a bool, got {prefix_decode!r}")
    from executorch.exir import EdgeCompileConfig, EdgeProgramManager, ExecutorchBackendConfig

    model = export_copy(model)
    dtype = next(model.parameters()).dtype
    if quantize is not None:
        model = quantize_weights_(model, quantize, embedding=quantize_embedding)
    B, C = batch_size, 1 if prefill_chunk is None else prefill_chunk
    # The rollback limit (what HostDecoder.rollback allows) covers a verify step's guesses.
    state = StaticState(cfg, B, C, dtype=dtype, rollback_limit=verify_len)
    # Every step of more than one token (verify too) attends expert by expert (`step.step`,
    # per_token_max=1). WHY: gathering each token's K expert caches is a copy in the runtime
    # (a portable index_select; Inductor reads the rows in place, so compiled verify steps keep
    # it), and C*K gathered caches outweigh the L read in place: verify/decode 1.43 against 1.81
    # on the bench model (docs/performance.md, "`.pte`").
    step = StepModule(model, state).eval()
    i64 = dict(dtype=torch.long)
    decode_name = "forward" if B == 1 else "decode"
    if B == 1:
        dec, dec_args = _Decode1(step), (torch.zeros(1, 1, **i64), torch.zeros(1, **i64))
    else:
        dec, dec_args = _Chunk(step, last=True), (torch.zeros(B, 1, **i64), torch.zeros(B, **i64),
                                         torch.ones(B, 1, dtype=torch.bool))
    pre_args = (torch.zeros(B, C, **i64), torch.zeros(B, **i64), torch.ones(B, C, dtype=torch.bool))
    methods = {decode_name: (dec, dec_args)}  # decode first: see _init_first_method_pass
    if prefill_chunk is not None:
        methods["prefill"] = (_Chunk(step, last=False, last_live=not full_logits), pre_args)
    full_prefill = prefill_chunk is not None and full_logits  # prefill can verify C tokens
    verify_method = None if verify_len is None else "prefill" if verify_len == C and full_prefill else "verify"
    if verify_method == "verify":  # speculative decoding's verify step: k + 1 tokens per row
        Cv = verify_len
        methods["verify"] = (_Chunk(step, last=False), (torch.zeros(B, Cv, **i64), torch.zeros(B, **i64),
                                                        torch.ones(B, Cv, dtype=torch.bool)))
    # Every step method but the stock runner's `forward` takes the slots it attends (P,) as a
    # bounded dynamic size: one method serves every length, and a step's sparse attention
    # costs what the rows' depth needs, not the capacity. `forward` keeps the whole cache; at
    # batch 1 with `prefix_decode`, a `decode` method with the slots is what `load_pte` runs.
    if lengths and B == 1 and prefix_decode:
        methods["decode"] = (_Chunk(step, last=True), (*dec_args, torch.ones(1, 1, dtype=torch.bool)))
    slots_methods = [name for name in methods if name != "forward"] if lengths else []
    if slots_methods:
        P = torch.export.Dim("P", min=lengths[0], max=lengths[-1])
        slots = slot_numbers(cfg.mosrah_cache_length)[:lengths[-1]]
        for name in slots_methods:
            mod, args = methods[name]
            methods[name] = (mod, (*args, slots), (*[None] * len(args), {0: P}))
    # _check_ir_validity=False, as ExecuTorch's llama export does. WHY: the edge verifier re-checks
    # every graph after every pass (a tenth of lowering time), and since a delegate holds a whole
    # norm + projections block (docs/performance.md, "`.pte`") it rejects, inside XNNPACK's own
    # preprocessing of such a partition, the `aten.linear` nodes the XNNPACK partitioner keeps
    # undecomposed for its linear kernel (SpecViolationError: "not in Core ATen opset"). What the
    # program runs is checked by running it (tests/test_export_pte.py: allowlisted kernels only).
    config = EdgeCompileConfig(_check_ir_validity=False)

    def export_and_lower(name):
        """Stages 1 and 2 of one method: `torch.export.export` (strict=False: the step has no
        data-dependent Python, no .item(), no branch on tensor data, so tracing it with Python
        gives the graph Dynamo's strict mode gives, in half the time), then
        `to_edge_transform_and_lower` with the XNNPACK delegates."""
        with without_leafspec_notice():
            return accelerators.export_and_lower({name: methods[name]}, xnnpack_partitioner(), {},
                                                 config).exported_program(name)

    meta = {
        "format": PTE_FORMAT, "batch_size": B, "prefill_chunk": C, "quantize": quantize,
        "quantize_embedding": quantize_embedding,
        "dtype": str(dtype).replace("torch.", ""), "decode_method": decode_name,
        "prefill_method": None if prefill_chunk is None else "prefill", "state_names": state.names(),
        "eos_token_id": eos_token_id, "bos_token_id": bos_token_id,
        "rollback_limit": state.rollback_limit, "verify_len": verify_len, "verify_method": verify_method,
        "full_logits": full_logits, "prefix_lengths": list(lengths), "slots_methods": slots_methods,
    }
    constants = {
        "get_max_seq_len": cfg.inference_sequence_length,
        "get_max_context_len": cfg.inference_sequence_length,
        "use_kv_cache": True,
        "enable_dynamic_shape": False,
        # Read by optimum-executorch's ExecuTorchModelForCausalLM (and the llama runners):
        # get_dtype is a c10::ScalarType code (6 float32, 5 float16, 15 bfloat16); an unknown
        # BOS is -1 and an unknown EOS an empty list (no stop token).
        "get_max_batch_size": B,
        "get_vocab_size": cfg.vocab_size,
        "get_dtype": _SCALAR_TYPE[dtype],
        "get_bos_id": -1 if bos_token_id is None else int(bos_token_id),
        "get_eos_ids": [] if eos_token_id is None else [int(eos_token_id)],
        "get_shram_config": cfg.to_json_string(use_diff=False),  # a string constant method
        "get_shram_export": json.dumps(meta),
    }
    # The stages, as ExecuTorch's llama export runs them: (1) torch.export and (2) to_edge with
    # the XNNPACK lowering, per method (the same program as lowering them together); (3)
    # to_executorch of all methods; (4) `export_pte` saves the bytes. The accelerators speed up
    # stages 1-3 from outside (`accelerators.lowering()`: the same program). With `parallel` the
    # decode method is lowered in a forked process. WHY that one: prefill's graph is the larger
    # (it takes longer to lower), and reading a forked method back here comes after this
    # process's own lowering.
    jobs = {name: functools.partial(export_and_lower, name) for name in reversed(methods)}
    with accelerators.lowering(), without_mutable_buffer_notice():
        edges = accelerators.lower_in_parallel(jobs, parallel)
        edge = EdgeProgramManager({name: edges[name] for name in methods}, constant_methods=constants,
                                  compile_config=config)
        return edge.to_executorch(ExecutorchBackendConfig(
            # shared mutable buffers (state_view_planning) + emit_mutable_buffer_names: both
            # methods address ONE copy of each state buffer (through executorch.runtime's Program;
            # portable_lib's Module API would give each method its own copy).
            memory_planning_pass=state_view_planning(),
            emit_mutable_buffer_names=True,
            # index_put -> index_put_: without it each cache write copies the whole buffer into a
            # temporary and back, a copy of every cache per step. Safe: the pass
            # only rewrites when the old buffer value is not read afterwards.
            run_reinplace_pass=True,
            passes=[_init_first_method_pass(state.names()), written_cache_views_pass],  # views.py
        ))


def export_pte(model, path, batch_size: int = 1, prefill_chunk: int | None = 32, quantize: str | None = None,
               eos_token_id: int | None = None, bos_token_id: int | None = None, *,
               quantize_embedding: bool = False, parallel: bool = True, verify_len: int | None = None,
               full_logits: bool = False, prefix_lengths=None, prefix_decode: bool = False) -> str:
    """Writes one ExecuTorch program (XNNPACK delegate, portable kernels for the rest).

    Args:
        model: a `ShramForCausalLM` (fp32; not modified).
        path: output `.pte` path (its directory is created).
        batch_size: B rows per call. B = 1 names the decode method `forward` with the stock
            runner's two inputs; B > 1 names it `decode` and adds per-row live flags.
        prefill_chunk: C tokens per `prefill` call; None writes no `prefill` method (decode
            only: the loaded decoder runs prompts token by token through the decode step).
        quantize: None (float weights), "int8" (dynamic int8 activations, int8 per-channel
            weights on every nn.Linear) or "8da4w" (int4 weights in groups of 32 where the input
            width allows); see `shram_static.export.quantize.quantize_weights`.
        eos_token_id: stored as `get_eos_ids` (the stock runner stops on it) and used by the
            loaded decoder's `generate`; default the config's `eos_token_id`.
        bos_token_id: stored as `get_bos_id`; default the config's `bos_token_id`.
        quantize_embedding: with `quantize`, also store the embedding table as int8 rows with
            per-row scales: a quarter of its bytes, no effect on step time, more logit drift
            (see `quantize_weights`). Needs `quantize`.
        parallel: lower the decode method in a forked process while this one lowers the prefill
            method (Linux, two or more usable CPUs; the same program; up to twice the peak
            memory). False: one process.
        verify_len: also write a `verify(tokens [B, n], input_pos [B], live [B, n])` method of
            n = verify_len tokens per row (speculative decoding: the last token and up to n - 1
            guesses; a `full_logits` `prefill` serves when n equals prefill_chunk), and build the state to roll
            back max(prefill_chunk, n) tokens (stored as `rollback_limit` in the metadata).
            None: no verify method; rollback up to prefill_chunk still works.
        full_logits: `prefill` returns every token's logits, [B, C, V], as evaluation
            (perplexity) needs. Default False: only each row's last live token's, [B, 1, V],
            which is all generation reads, and the lm_head then runs on B rows instead of
            B x C (the same default as ExecuTorch's llama export, `generate_full_logits`).
        prefix_lengths: the prefix lengths of the sparse caches the step methods attend
            (`common.export_prefix_lengths`; default powers of two from 64, then the whole
            cache; () for whole-cache methods): every method but `forward` takes one more input,
            `slots` [P] float32 (`slot_numbers(T)[:P]`), P a bounded dynamic size, and
            `load_pte` picks the shortest length holding every row's live slots. Recorded in
            the metadata (`prefix_lengths`, `slots_methods`).
        prefix_decode: at batch 1 with prefix lengths, also write `decode(tokens [1, 1],
            input_pos [1], live [1, 1], slots [P])`, the decode step over a prefix that
            `load_pte` then runs (`forward` keeps the whole cache for stock runners). One more
            method to lower (docs/performance.md, "`.onnx`": the export's time and what it buys).

    Returns:
        The path written.
    """
    et = lower_program(model, batch_size, prefill_chunk, quantize, eos_token_id, bos_token_id,
                       quantize_embedding=quantize_embedding, parallel=parallel, verify_len=verify_len,
                       full_logits=full_logits, prefix_lengths=prefix_lengths, prefix_decode=prefix_decode)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(et.buffer)
    return path
