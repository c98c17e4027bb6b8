"""ONNX export of the static steps as pure functions, and an onnxruntime decoder.

Files for `export_onnx(model, "m.onnx", ...)`:
  * `m.onnx`: the decode graph (C = 1), a complete model on its own;
  * `m.prefill.onnx`: the prefill graph (C = prefill_chunk); none with `prefill_chunk=None`
    (decode only: prompts then go token by token through the decode graph);
  * `m.onnx.data`: the weights of both, stored once (external data, deduplicated by content).
Each graph is `(input_ids [B, C] int64, position_ids [B] int64, live [B, C] bool,
past.<name>...) -> (logits [B, C, V], present.<name>...)` over the state tensors of
`StaticState.names()`; `position_ids` is the number of live tokens each row holds before the
call (the position of its first live token). The model config and the export parameters are
JSON strings in `metadata_props` (`shram_config`, `shram_export`).

WHY pure functions: the dynamo exporter turns in-place buffer mutations into constant
initializers and drops the updates without a warning (the graph would forget its state).
WHY two graphs in sibling files: each step has fixed shapes (static graphs are the point), so
one graph per C; `m.onnx` stays a plain single-step model any ONNX tool can open, and the shared
data file keeps the weights on disk once.
"""

import functools
import hashlib
import json
import os
import uuid

import numpy as np
import torch

from ..config import ShramConfig
from ..console import without_leafspec_notice
from ..host import HostDecoder
from ..state import StaticState
from ..step import FunctionalStep
from .decompose import onnx_decomposed
from .forked import run_jobs
from .lowering import without_onnx_rewrite_rules
from .pte import ExportFormatError, check_export_args, export_copy

FORMAT = "shram_static.onnx/1"
_ALIGN = 64  # byte alignment of each tensor in the shared data file
_NP_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(bool)": np.bool_, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
              "tensor(uint8)": np.uint8}


def graph_paths(path) -> dict[str, str]:
    """The files of one export: {"decode": m.onnx, "prefill": m.prefill.onnx, "data": m.onnx.data}.

    Args:
        path: the decode graph's path (`m.onnx`).
    """
    path = os.fspath(path)
    stem = path[:-5] if path.endswith(".onnx") else path
    return {"decode": path, "prefill": stem + ".prefill.onnx", "data": path + ".data"}


# ----------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------

def _export_graph(fn: FunctionalStep, state: StaticState, C: int):
    """torch.onnx.export (dynamo, opset 23) of the pure step for chunk length C, its RMSNorms,
    RoPEs and max trees fused (`onnx_fusions`); returns the ModelProto."""
    from .onnx_fusions import OPSET, fuse_onnx_ops  # imports onnxscript: only when exporting

    B = state.batch_size
    names = state.names()
    args = (torch.zeros(B, C, dtype=torch.long), torch.zeros(B, dtype=torch.long),
            torch.ones(B, C, dtype=torch.bool), *[t.clone() for t in state.tensors()])
    with torch.no_grad(), without_onnx_rewrite_rules(), without_leafspec_notice(), onnx_decomposed(fn, args, OPSET) as ep:
        prog = torch.onnx.export(
            ep, args, dynamo=True, optimize=True, verbose=False, opset_version=OPSET,
            input_names=["input_ids", "position_ids", "live", *[f"past.{n}" for n in names]],
            output_names=["logits", *[f"present.{n}" for n in names]],
        )
    fuse_onnx_ops(prog.model)
    return prog.model_proto


def _externalize(models: list, data_path: str, min_bytes: int = 1024) -> None:
    """Moves the initializers of `models` (>= min_bytes) into ONE data file, each distinct
    tensor stored once; rewrites the protos to reference it.

    WHY by content, not by name: the exporter folds transposed weights into constants with
    generated names (`val_14`), which differ between the two graphs even for the same weight.
    """
    from onnx import numpy_helper
    from onnx.external_data_helper import set_external_data

    where: dict[bytes, tuple[int, int]] = {}
    with open(data_path, "wb") as f:
        for model in models:
            for t in model.graph.initializer:
                arr = numpy_helper.to_array(t)
                if arr.nbytes < min_bytes:
                    continue
                raw = np.ascontiguousarray(arr).tobytes()
                key = hashlib.sha256(raw + str((arr.dtype, arr.shape)).encode()).digest()
                if key not in where:
                    pad = (-f.tell()) % _ALIGN
                    f.write(b"\0" * pad)
                    where[key] = (f.tell(), len(raw))
                    f.write(raw)
                offset, length = where[key]
                t.CopyFrom(numpy_helper.from_array(arr, t.name))  # normalise to raw_data
                set_external_data(t, location=os.path.basename(data_path), offset=offset, length=length)
                t.ClearField("raw_data")


def export_onnx(model, path, batch_size: int = 1, prefill_chunk: int | None = 32,
                eos_token_id: int | None = None, *, parallel: bool = True) -> dict[str, str]:
    """Writes the decode and prefill graphs and their shared weights (see module docstring).

    Args:
        model: a `ShramForCausalLM` (not modified).
        path: the decode graph's path, `m.onnx`; `m.prefill.onnx` and `m.onnx.data` go beside it.
        batch_size: B rows per call.
        prefill_chunk: C tokens per prefill call; None writes no prefill graph (decode only,
            half the export work) and removes a `m.prefill.onnx` an earlier export left there.
        eos_token_id: stored in the metadata; the loaded decoder's `generate` stops on it.
        parallel: export the decode graph in a forked process while this one exports the
            prefill graph (Linux, two or more usable CPUs; the same graphs; up to twice the
            peak memory). False: one process.

    Returns:
        The paths written, as `graph_paths(path)` (without "prefill" when decode only).
    """
    import onnx

    cfg: ShramConfig = model.config
    if not isinstance(parallel, bool):
        raise TypeError(f"parallel must be a bool, got {parallel!r}")
    C = 1 if prefill_chunk is None else prefill_chunk
    check_export_args(cfg, batch_size, C, eos_token_id)
    model = export_copy(model)
    dtype = next(model.parameters()).dtype
    state = StaticState(cfg, batch_size, C, dtype=dtype)
    fn = FunctionalStep(model, state).eval()
    paths = graph_paths(path)
    os.makedirs(os.path.dirname(os.path.abspath(paths["decode"])), exist_ok=True)
    export_id = uuid.uuid4().hex  # ties the files of one export together
    # With `parallel`, the decode graph is exported in a forked process while this one exports
    # the (larger) prefill graph (shram_static/export/forked.py); a graph travels back as bytes.
    chunks = {"decode": 1} if prefill_chunk is None else {"decode": 1, "prefill": C}
    jobs = {role: functools.partial(_export_graph, fn, state, chunks[role]) for role in reversed(chunks)}
    protos = run_jobs(jobs, lambda m: m.SerializeToString(), onnx.ModelProto.FromString, parallel)
    models = {}
    for role, c in chunks.items():
        m = protos[role]
        meta = {"format": FORMAT, "role": role, "roles": list(chunks), "export_id": export_id,
                "batch_size": batch_size, "prefill_chunk": C, "chunk": c, "state_names": state.names(),
                "eos_token_id": eos_token_id, "dtype": str(dtype).replace("torch.", "")}
        onnx.helper.set_model_props(m, {"shram_config": cfg.to_json_string(use_diff=False),
                                         "shram_export": json.dumps(meta)})
        models[role] = m
    _externalize(list(models.values()), paths["data"])
    for role, m in models.items():
        onnx.save(m, paths[role])
        # the path form of the checker also reads the external data file
        onnx.checker.check_model(paths[role], full_check=True)
    if prefill_chunk is None and os.path.exists(paths["prefill"]):
        os.remove(paths["prefill"])  # another export's graph: it must not pass for this one's
    return {role: paths[role] for role in (*chunks, "data")}


# ----------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------

def _read_meta(path: str) -> tuple[dict, dict]:
    """(config dict, export dict) from a graph's metadata_props, without loading weights."""
    import onnx
    try:
        m = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends
        raise ExportFormatError(f"{path} is not a readable ONNX model (truncated or corrupt?): {e}") from e
    props = {p.key: p.value for p in m.metadata_props}
    if "shram_export" not in props or "shram_config" not in props:
        raise ExportFormatError(f"{path} has no shram metadata: it was not written by "
                                f"shram_static.export.export_onnx")
    meta = json.loads(props["shram_export"])
    if meta.get("format") != FORMAT:
        raise ExportFormatError(f"{path} has format {meta.get('format')!r}; this version reads {FORMAT!r}")
    return json.loads(props["shram_config"]), meta


class _Graph:
    """One onnxruntime session with a reusable IOBinding and a preallocated logits buffer."""

    def __init__(self, path: str, threads: int | None):
        import onnxruntime as ort
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        try:
            self.sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise ExportFormatError(f"onnxruntime cannot load {path} (truncated, or its .data file "
                                    f"is missing or damaged?): {e}") from e
        self.inputs = {i.name: i for i in self.sess.get_inputs()}
        self.binding = self.sess.io_binding()
        shape = self.sess.get_outputs()[0].shape
        self.logits = np.zeros(shape, dtype=_NP_DTYPES[self.sess.get_outputs()[0].type])
        self._logits_ov = ort.OrtValue.ortvalue_from_numpy(self.logits)
        self.binding.bind_ortvalue_output("logits", self._logits_ov)

    def bind_state(self, names, past, present) -> None:
        for n, a, b in zip(names, past, present):
            self.binding.bind_ortvalue_input(f"past.{n}", a)
            self.binding.bind_ortvalue_output(f"present.{n}", b)

    def run(self, ids: np.ndarray, pos: np.ndarray, live: np.ndarray) -> np.ndarray:
        self._keep = (ids, pos, live)  # the binding points into these arrays until the run ends
        self.binding.bind_cpu_input("input_ids", ids)
        self.binding.bind_cpu_input("position_ids", pos)
        self.binding.bind_cpu_input("live", live)
        self.sess.run_with_iobinding(self.binding)
        return self.logits.copy()


class OnnxDecoder(HostDecoder):
    """`HostDecoder` over the graphs written by `export_onnx`, run in onnxruntime.

    The state lives in OrtValues that never leave onnxruntime between steps. With
    `inplace=True` each `present.X` output is bound to the very OrtValue of `past.X`, so a step
    updates the state where it lies (no copy of the whole state per step); this is correct
    because no node of the graphs reads an old state tensor after writing it (tested against
    `inplace=False`, which alternates two state sets).

    Args:
        path: the decode graph `m.onnx` (`m.prefill.onnx` and `m.onnx.data` beside it; a
            decode-only export has no prefill graph and feeds prompts token by token).
        inplace: alias outputs to inputs (fast) or alternate two state sets (reference).
        threads: onnxruntime intra-op threads (default: onnxruntime's choice).
    """

    def __init__(self, path, inplace: bool = True, threads: int | None = None):
        import onnxruntime as ort
        paths = graph_paths(path)
        _need_file(paths["decode"])
        cfg_d, meta = _read_meta(paths["decode"])
        if meta.get("role") != "decode":
            raise ExportFormatError(f"{paths['decode']} holds the {meta.get('role')!r} graph, expected decode")
        roles = meta.get("roles", ["decode", "prefill"])  # absent: written before decode-only exports
        for role in [r for r in roles if r != "decode"] + ["data"]:
            _need_file(paths[role])
        if "prefill" in roles:
            _, meta_p = _read_meta(paths["prefill"])
            if meta_p.get("role") != "prefill":
                raise ExportFormatError(f"{paths['prefill']} holds the {meta_p.get('role')!r} graph, "
                                        f"expected prefill")
            if meta_p.get("export_id") != meta.get("export_id"):
                raise ExportFormatError(f"{paths['prefill']} comes from another export than "
                                        f"{paths['decode']} (export ids differ): re-export both")
        config = ShramConfig.from_dict(cfg_d)
        super().__init__(config, meta["batch_size"], meta["prefill_chunk"], meta.get("eos_token_id"))
        self.paths, self.meta, self.inplace = paths, meta, inplace
        self.names = list(meta["state_names"])
        self._graphs = {role: _Graph(paths[role], threads) for role in roles}
        B, C, V = self.batch_size, self.prefill_chunk, config.vocab_size
        for role, g in self._graphs.items():
            c = 1 if role == "decode" else C
            if g.inputs["input_ids"].shape != [B, c] or list(g.logits.shape) != [B, c, V]:
                raise ExportFormatError(f"{paths[role]} takes input_ids {g.inputs['input_ids'].shape} and "
                                        f"returns logits {list(g.logits.shape)}, but its config says "
                                        f"{[B, c]} -> {[B, c, V]} (a file from another config?)")
        # Starting state: zeros (finite; stale slots are masked by position, never cleared).
        dec_in = self._graphs["decode"].inputs
        self._arrays = [[np.zeros(dec_in[f"past.{n}"].shape, _NP_DTYPES[dec_in[f"past.{n}"].type])
                         for n in self.names] for _ in range(1 if inplace else 2)]
        # OrtValue.ortvalue_from_numpy does not own the array: self._arrays keeps them alive.
        self._state = [[ort.OrtValue.ortvalue_from_numpy(a) for a in arrs] for arrs in self._arrays]
        if inplace:
            for g in self._graphs.values():
                g.bind_state(self.names, self._state[0], self._state[0])

    def _run(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        g = self._graphs["decode" if tokens.shape[1] == 1 else "prefill"]
        if not self.inplace:
            g.bind_state(self.names, self._state[0], self._state[1])
            self._state.reverse()  # after this run the outputs are the current state
            self._arrays.reverse()
        out = g.run(np.ascontiguousarray(tokens.numpy(), dtype=np.int64),
                    np.ascontiguousarray(input_pos.numpy(), dtype=np.int64),
                    np.ascontiguousarray(live.numpy(), dtype=np.bool_))
        return torch.from_numpy(out)

    def _reset_state(self) -> None:
        # Not needed for correctness (position 0 masks every stale slot); keeps a reset
        # decoder byte-identical to a fresh one.
        for arrs in self._arrays:
            for a in arrs:
                a.fill(0)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Current state as numpy arrays by name (views of the live buffers)."""
        return dict(zip(self.names, self._arrays[0]))


def _need_file(path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ONNX export file {path!r} does not exist (an export of m.onnx is m.onnx, "
                                f"m.prefill.onnx unless decode only, and m.onnx.data)")


def load_onnx(path, inplace: bool = True, threads: int | None = None) -> OnnxDecoder:
    """Loads the graphs written by `export_onnx` as a decoder with the `StaticDecoder` API.

    Args:
        path: `m.onnx` (its siblings `m.prefill.onnx` and `m.onnx.data` are found by name).
        inplace: bind each present output to its past input (default; see `OnnxDecoder`).
        threads: onnxruntime intra-op threads.

    Returns:
        An `OnnxDecoder` (`prefill`, `decode`, `reset`, `generate`).

    Raises:
        FileNotFoundError: a file of the export is missing.
        ExportFormatError: a file is truncated, foreign, or from another export / config.
    """
    return OnnxDecoder(path, inplace=inplace, threads=threads)
