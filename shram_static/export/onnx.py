"""ONNX export of the static steps as pure functions (`export_onnx`); `onnx_runtime.py` runs them.

`export_onnx(model, "m.onnx")` writes `m.onnx` (decode, C = 1), `m.prefill.onnx` (unless
`prefill_chunk=None`), `m.verify.onnx` (with `verify_len`) and `m.onnx.data` (the weights of all
graphs, stored once). Each graph is `(input_ids [B, C], position_ids [B], live [B, C][, slots
[P]], past.<name>...) -> (logits, present.<name>...)`; the config and export parameters are JSON
in `metadata_props` (`shram_config`, `shram_export`). WHY pure functions: the dynamo exporter
drops in-place buffer updates without a warning. See docs/reference.md and docs/design.md.
"""

import functools
import hashlib
import json
import os
import uuid

import numpy as np
import torch

from .. import accelerators
from ..config import ShramConfig
from ..console import quiet_loggers, without_leafspec_notice
from ..state import StaticState, slot_numbers
from ..step import FunctionalStep, step
from .common import ONNX_FORMAT, SLOTS_INPUT, check_export_args, export_copy, export_prefix_lengths, graph_paths
from .onnx_quantize import ACCURACY_LEVEL, BLOCK, check_onnx_quantize, quantize_graph

_ALIGN = 64  # byte alignment of each tensor in the shared data file


class _SlotsStep(FunctionalStep):
    """The pure step over the first P sparse slots of each expert's cache (`slots` (P,) float32)."""

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor, slots: torch.Tensor,
                *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, new_state = step(self.model, list(state), tokens, input_pos, live, self.ring, inplace=False,
                                 per_token_max=self.per_token_max, last_only=self.last_only, slots=slots,
                                 rows_out=self.rows_out)
        return (logits, *new_state)


def _export_graph(fn: FunctionalStep, state: StaticState, C: int, lengths: tuple[int, ...] = ()):
    """torch.onnx.export (dynamo, opset 23, ops fused by `onnx_fusions`) of the step for chunk C;
    with `lengths`, `slots` [P] is a required input (WHY: IOBinding cannot bind an overridable
    initializer)."""
    from .onnx_fusions import OPSET, fuse_onnx_ops  # imports onnxscript: only when exporting

    B = state.batch_size
    names = state.names()
    slots = slot_numbers(fn.model.config.mosrah_cache_length)[:lengths[-1]] if lengths else None
    args = (torch.zeros(B, C, dtype=torch.long), torch.zeros(B, dtype=torch.long),
            torch.ones(B, C, dtype=torch.bool), *([slots] if lengths else []), *[t.clone() for t in state.tensors()])
    # tokens, input_pos, live, slots, the state (*state: one entry). WHY {} and not None per state
    # tensor: torch.onnx.export turns a tuple of Nones into a list, which torch.export rejects
    dynamic = (None, None, None, {0: torch.export.Dim("P", min=lengths[0], max=lengths[-1])},
               ({},) * len(names)) if lengths else None
    # WHY torch.onnx's logs at ERROR only: its registry warns per torchvision operator it skips
    with torch.no_grad(), accelerators.onnx_export(), without_leafspec_notice(), quiet_loggers("torch.onnx"):
        prog = torch.onnx.export(
            fn, args, dynamo=True, optimize=True, verbose=False, opset_version=OPSET,
            input_names=["input_ids", "position_ids", "live", *([SLOTS_INPUT] if lengths else []),
                         *[f"past.{n}" for n in names]],
            output_names=["logits", *[f"present.{n}" for n in names]],
            dynamic_shapes=dynamic,
        )
    fuse_onnx_ops(prog.model)
    return prog.model_proto


def _externalize(models: list, data_path: str, min_bytes: int = 1024) -> None:
    """Moves the initializers of `models` (>= min_bytes) into ONE data file, each distinct
    tensor once. WHY by content: the exporter's generated names differ between graphs."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import set_external_data

    where: dict[bytes, tuple[int, int]] = {}
    with open(data_path, "wb") as f:
        for model in models:
            for t in model.graph.initializer:
                packed = t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4) and t.HasField("raw_data")
                # WHY: numpy holds int4 unpacked (a byte each); its packed raw_data is what is stored
                arr = np.frombuffer(t.raw_data, np.uint8) if packed else numpy_helper.to_array(t)
                if arr.nbytes < min_bytes:
                    continue
                raw = np.ascontiguousarray(arr).tobytes()
                key = hashlib.sha256(raw + str((arr.dtype, arr.shape)).encode()).digest()
                if key not in where:
                    f.write(b"\0" * ((-f.tell()) % _ALIGN))
                    where[key] = (f.tell(), len(raw))
                    f.write(raw)
                offset, length = where[key]
                if not packed:
                    t.CopyFrom(numpy_helper.from_array(arr, t.name))  # normalise to raw_data
                set_external_data(t, location=os.path.basename(data_path), offset=offset, length=length)
                t.ClearField("raw_data")


def export_onnx(model, path, batch_size: int = 1, prefill_chunk: int | None = 32,
                eos_token_id: int | None = None, *, parallel: bool = True,
                verify_len: int | None = None, full_logits: bool = False,
                quantize: str | None = None, quantize_embedding: bool = False,
                prefix_lengths=None, row_writes: bool = False) -> dict[str, str]:
    """Writes the decode and prefill graphs and their shared weights (see module docstring).

    Args:
        model: a `ShramForCausalLM` (not modified).
        path: the decode graph's path, `m.onnx`; the other files go beside it.
        batch_size: B rows per call.
        prefill_chunk: C tokens per prefill call; None: no prefill graph (decode only), and a
            `m.prefill.onnx` an earlier export left there is removed.
        eos_token_id: stored in the metadata; the loaded decoder's `generate` stops on it; default
            the config's.
        parallel: export the decode graph in a forked process (Linux, 2+ CPUs; up to 2x the peak memory).
        verify_len: also write `m.verify.onnx` of verify_len tokens per row (speculative
            decoding), and build the state to roll back max(C, verify_len) tokens.
        full_logits: the prefill graph returns every token's logits [B, C, V] (scoring text), not [B, 1, V].
        quantize: None, "int8" or "int4": MatMuls with a constant weight become `MatMulNBits`
            (blocks of 32 inputs; `onnx_quantize.py`).
        quantize_embedding: with quantize="int4", the token embedding too (`GatherBlockQuantized`).
        prefix_lengths: the prefix lengths of the sparse caches the graphs attend
            (`common.export_prefix_lengths`; () for whole-cache graphs): every graph takes
            `slots` [P] float32, P a dynamic size.
        row_writes: also write `m.rows.onnx`, the decode step for a runtime that keeps the state
            and takes back only the rows a step writes (`export_web`'s module): it reads the
            expert caches before writing them (`StepMode.rows_out`), so with its outputs the
            written rows (`web.row_writes_graph`) onnxruntime does not copy those caches whole.
            Not a graph `load_onnx` runs.

    Returns:
        The paths written, as `graph_paths(path, verify)` (without "prefill" when decode only,
        "decode_rows" only with `row_writes`).
    """
    cfg: ShramConfig = model.config
    C = 1 if prefill_chunk is None else prefill_chunk
    eos_token_id, _ = check_export_args(cfg, batch_size, C, eos_token_id, parallel=parallel,
                                        full_logits=full_logits, verify_len=verify_len)
    check_onnx_quantize(quantize)
    lengths = export_prefix_lengths(cfg, prefix_lengths)
    if quantize_embedding and quantize != "int4":
        raise ValueError(f"quantize_embedding needs quantize='int4' (int4 rows), got quantize={quantize!r}")
    import onnx

    model = export_copy(model)
    dtype = next(model.parameters()).dtype
    state = StaticState(cfg, batch_size, C, dtype=dtype, rollback_limit=verify_len)
    # Steps of more than one token attend expert by expert, as in `export_pte` (Gather copies too).
    kind = _SlotsStep if lengths else FunctionalStep
    fns = {last: kind(model, state, last_only=last).eval() for last in (False, True)}  # by last_only
    paths = graph_paths(path, verify=True, rows=True)
    os.makedirs(os.path.dirname(os.path.abspath(paths["decode"])), exist_ok=True)
    export_id = uuid.uuid4().hex  # ties the files of one export together
    # With `parallel`, the decode graph is exported in a forked process; it travels back as bytes.
    chunks = {"decode": 1} if prefill_chunk is None else {"decode": 1, "prefill": C}
    if verify_len is not None:
        chunks["verify"] = verify_len
    roles = list(chunks)  # what `load_onnx` runs
    step_of = {role: fns[role == "prefill" and not full_logits] for role in roles}
    if row_writes:
        chunks["decode_rows"] = 1
        step_of["decode_rows"] = kind(model, state, rows_out=True).eval()
    jobs = {role: functools.partial(_export_graph, step_of[role], state, chunks[role], lengths)
            for role in reversed(chunks)}
    protos = accelerators.run_jobs(jobs, lambda m: m.SerializeToString(), onnx.ModelProto.FromString, parallel)
    models = {}
    for role, c in chunks.items():
        m = protos[role]
        quantized = {}
        if quantize is not None:
            m, n = quantize_graph(m, quantize, embedding=quantize_embedding)
            quantized = {"quantized_matmuls": n, "quantize_block": BLOCK, "accuracy_level": ACCURACY_LEVEL,
                         "quantized_embedding": quantize_embedding}
        meta = {"format": ONNX_FORMAT, "role": role, "roles": roles, "export_id": export_id,
                "quantize": quantize, **quantized, "batch_size": batch_size, "prefill_chunk": C, "chunk": c,
                "state_names": state.names(), "rollback_limit": state.rollback_limit,
                "verify_len": verify_len, "full_logits": full_logits, "eos_token_id": eos_token_id,
                "dtype": str(dtype).replace("torch.", ""), "prefix_lengths": list(lengths)}
        onnx.helper.set_model_props(m, {"shram_config": cfg.to_json_string(use_diff=False),
                                         "shram_export": json.dumps(meta)})
        models[role] = m
    _externalize(list(models.values()), paths["data"])
    for role, m in models.items():
        onnx.save(m, paths[role])
        onnx.checker.check_model(paths[role], full_check=True)  # by path: reads the data file too
    for role in ("prefill", "verify", "decode_rows"):
        if role not in chunks and os.path.exists(paths[role]):
            os.remove(paths[role])  # another export's graph: it must not pass for this one's
    return {role: paths[role] for role in (*chunks, "data")}
