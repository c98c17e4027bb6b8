"""ExecuTorch export (`.pte`, XNNPACK) of the static steps (`export_pte`); `pte_runtime.py` runs it.

One program holds the decode step (`forward(tokens, input_pos)` at batch 1, the stock
`TextLLMRunner`'s signature, else `decode(tokens, input_pos, live)`), `prefill` (unless
`prefill_chunk=None`), optionally `verify` and a batch-1 `decode` with slots, and constant
methods for the stock runner, optimum-executorch and `load_pte` (`get_shram_config`,
`get_shram_export`). The step methods share one set of mutable state buffers. See
docs/design.md, "How each backend runs the step", and docs/reference.md.
"""

import functools
import json
import os

import torch
from torch import nn

from .. import accelerators
from ..config import ShramConfig
from ..console import without_leafspec_notice, without_mutable_buffer_notice
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
    """Batched step with live flags (and optional slots): logits `[B, C, V]`, `[B, 1, V]` with
    `last_live` (prefill) or `[B, V]` with `last` (batched decode)."""

    def __init__(self, step: StepModule, last: bool, last_live: bool = False):
        super().__init__()
        self.step, self.last, self.last_live = step, last, last_live

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.step(tokens, input_pos, live, last_only=self.last_live, slots=slots)
        return logits[:, -1, :] if self.last else logits


def _init_first_method_pass(names):
    """A pass marking the state buffers of the FIRST method it sees as initialised (`et_init_buffer`,
    as ExecuTorch's `InitializedMutableBufferPass`, which re-traces the graph: seconds per method).

    WHY: unmarked, a fresh program's state is whatever the allocator left (a NaN in a masked slot
    poisons attention: 0 * NaN); marked, its starting bytes are stored per method: decode's only.
    """
    from torch.fx.passes.infra.pass_base import PassResult

    # Placeholder names are the FQNs with dots as underscores, matched as substrings as
    # ExecuTorch's pass does ("..._layers_1_taken" is no substring of "..._layers_11_taken").
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
    """Exports and lowers the steps, as `export_pte` without writing.

    Args: as `export_pte`.

    Returns:
        The `ExecutorchProgramManager`; `.buffer` is the .pte bytes.
    """
    cfg: ShramConfig = model.config
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
    if not isinstance(quantize_embedding, bool):
        raise TypeError(f"quantize_embedding must be a bool, got {quantize_embedding!r}")
    if quantize_embedding and quantize is None:
        raise ValueError("quantize_embedding applies with quantize='int8' or '8da4w'")
    B, C = batch_size, 1 if prefill_chunk is None else prefill_chunk
    eos_token_id, bos_token_id = check_export_args(cfg, B, C, eos_token_id, bos_token_id, parallel=parallel,
                                                   full_logits=full_logits, verify_len=verify_len)
    lengths = export_prefix_lengths(cfg, prefix_lengths)
    if not isinstance(prefix_decode, bool):
        raise TypeError(f"prefix_decode must be a bool, got {prefix_decode!r}")
    from executorch.exir import EdgeCompileConfig, EdgeProgramManager, ExecutorchBackendConfig

    model = export_copy(model)
    dtype = next(model.parameters()).dtype
    if quantize is not None:
        model = quantize_weights_(model, quantize, embedding=quantize_embedding)
    state = StaticState(cfg, B, C, dtype=dtype, rollback_limit=verify_len)
    # Steps of more than one token attend expert by expert (`step.step`). WHY: gathering each
    # token's K expert caches is a portable copy in the runtime (docs/performance.md, "`.pte`").
    step = StepModule(model, state).eval()

    def step_args(c):  # tokens [B, c], input_pos [B], live [B, c]
        return (torch.zeros(B, c, dtype=torch.long), torch.zeros(B, dtype=torch.long),
                torch.ones(B, c, dtype=torch.bool))

    decode_name = "forward" if B == 1 else "decode"
    dec = (_Decode1(step), step_args(1)[:2]) if B == 1 else (_Chunk(step, last=True), step_args(1))
    methods = {decode_name: dec}  # decode first: see _init_first_method_pass
    if prefill_chunk is not None:
        methods["prefill"] = (_Chunk(step, last=False, last_live=not full_logits), step_args(C))
    full_prefill = prefill_chunk is not None and full_logits  # prefill can verify C tokens
    verify_method = (None if verify_len is None else
                     "prefill" if verify_len == C and full_prefill else "verify")
    if verify_method == "verify":  # speculative decoding's verify step: k + 1 tokens per row
        methods["verify"] = (_Chunk(step, last=False), step_args(verify_len))
    # Every step method but `forward` takes its slots (P,), a bounded dynamic size.
    if lengths and B == 1 and prefix_decode:
        methods["decode"] = (_Chunk(step, last=True), step_args(1))
    slots_methods = [name for name in methods if name != "forward"] if lengths else []
    if slots_methods:
        P = torch.export.Dim("P", min=lengths[0], max=lengths[-1])
        slots = slot_numbers(cfg.mosrah_cache_length)[:lengths[-1]]
        for name in slots_methods:
            mod, args = methods[name]
            methods[name] = (mod, (*args, slots), (*[None] * len(args), {0: P}))
    # _check_ir_validity=False, as ExecuTorch's llama export does. WHY: the edge verifier rejects
    # the `aten.linear` nodes XNNPACK keeps for its linear kernel ("not in Core ATen opset"); the
    # program is checked by running it (tests/test_export_pte.py: allowlisted kernels only).
    config = EdgeCompileConfig(_check_ir_validity=False)

    def export_and_lower(name):
        """`torch.export` (non-strict: no data-dependent Python), `to_edge_transform_and_lower`."""
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
    S = cfg.inference_sequence_length
    constants = {
        "get_max_seq_len": S, "get_max_context_len": S, "use_kv_cache": True, "enable_dynamic_shape": False,
        # Read by optimum-executorch's ExecuTorchModelForCausalLM (and the llama runners).
        "get_max_batch_size": B, "get_vocab_size": cfg.vocab_size, "get_dtype": _SCALAR_TYPE[dtype],
        "get_bos_id": -1 if bos_token_id is None else int(bos_token_id),
        "get_eos_ids": [] if eos_token_id is None else [int(eos_token_id)],
        "get_shram_config": cfg.to_json_string(use_diff=False),  # a string constant method
        "get_shram_export": json.dumps(meta),
    }
    # As in ExecuTorch's llama export: lowered per method, then to_executorch of all. WHY the
    # decode method is the forked one: prefill's graph is larger, so it is read back after it.
    jobs = {name: functools.partial(export_and_lower, name) for name in reversed(methods)}
    with accelerators.lowering(), without_mutable_buffer_notice():
        edges = accelerators.lower_in_parallel(jobs, parallel)
        edge = EdgeProgramManager({name: edges[name] for name in methods}, constant_methods=constants,
                                  compile_config=config)
        return edge.to_executorch(ExecutorchBackendConfig(
            # every method addresses ONE copy of each state buffer (through executorch.runtime)
            memory_planning_pass=state_view_planning(),
            emit_mutable_buffer_names=True,
            # index_put -> index_put_: else each cache write copies the whole buffer per step
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
        batch_size: B rows per call; B = 1 names the decode method `forward` (the stock runner's
            two inputs), B > 1 names it `decode` with per-row live flags.
        prefill_chunk: C tokens per `prefill` call; None: no `prefill` (prompts run token by token).
        quantize: None, "int8" (int8 dynamic activations and per-channel weights) or "8da4w"
            (int4 weights in groups of 32 where the width allows); see `quantize_weights`.
        eos_token_id: stored as `get_eos_ids` and used by `generate`; default the config's.
        bos_token_id: stored as `get_bos_id`; default the config's.
        quantize_embedding: with `quantize`, the embedding too, as int8 rows (1/4 the bytes, more drift).
        parallel: lower the decode method in a forked process (Linux, 2+ CPUs; up to 2x the peak memory).
        verify_len: also write `verify(tokens [B, n], input_pos, live)` of n tokens per row
            (speculative decoding; a `full_logits` prefill serves when n == C), and build the
            state to roll back max(C, n) tokens (`rollback_limit`).
        full_logits: `prefill` returns every token's logits [B, C, V] (scoring text), not [B, 1, V].
        prefix_lengths: the prefix lengths of the sparse caches the step methods attend
            (`common.export_prefix_lengths`; () for whole-cache methods): every method but
            `forward` takes `slots` [P] float32, P a bounded dynamic size.
        prefix_decode: at batch 1 with prefix lengths, also write `decode(tokens, input_pos,
            live, slots)`, which `load_pte` then runs (`forward` keeps the whole cache).

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
