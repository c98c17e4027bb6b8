"""Runs `export_onnx`'s graphs in onnxruntime behind the `StaticDecoder` API (`OnnxDecoder`,
`load_onnx`). Imports onnx / onnxruntime only inside its functions, never the exporter."""

import json
import os

import numpy as np
import torch

from ..config import ShramConfig
from ..errors import ExportFormatError
from ..host import HostDecoder
from ..state import PrefixSlots
from .common import ONNX_FORMAT, SLOTS_INPUT, graph_paths

_NP_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(bool)": np.bool_, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
              "tensor(uint8)": np.uint8}


def _read_meta(path: str, role: str) -> tuple[dict, dict]:
    """(config dict, export dict) from the metadata_props of `role`'s graph, without loading weights."""
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
    if meta.get("format") != ONNX_FORMAT:
        raise ExportFormatError(f"{path} has format {meta.get('format')!r}; this version reads {ONNX_FORMAT!r}")
    if meta.get("role") != role:
        raise ExportFormatError(f"{path} holds the {meta.get('role')!r} graph, expected {role}")
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
        out = self.sess.get_outputs()[0]
        self.logits = np.zeros(out.shape, dtype=_NP_DTYPES[out.type])
        self._logits_ov = ort.OrtValue.ortvalue_from_numpy(self.logits)
        self.binding.bind_ortvalue_output("logits", self._logits_ov)

    def bind_state(self, names, past, present) -> None:
        for n, a, b in zip(names, past, present):
            self.binding.bind_ortvalue_input(f"past.{n}", a)
            self.binding.bind_ortvalue_output(f"present.{n}", b)

    def run(self, ids: np.ndarray, pos: np.ndarray, live: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        self._keep = (ids, pos, live, slots)  # the binding points into these arrays until the run ends
        for name, a in (("input_ids", ids), ("position_ids", pos), ("live", live), (SLOTS_INPUT, slots)):
            if a is not None:
                self.binding.bind_cpu_input(name, a)
        self.sess.run_with_iobinding(self.binding)
        return self.logits.copy()


class OnnxDecoder(HostDecoder):
    """`HostDecoder` over the graphs written by `export_onnx`, run in onnxruntime.

    The state lives in OrtValues. With `inplace=True` each `present.X` output is bound to the
    OrtValue of `past.X`, so a step updates the state where it lies (correct: no node reads an
    old state tensor after writing it; tested against `inplace=False`).

    Args:
        path: the decode graph `m.onnx` (its sibling files are found by name).
        inplace: alias outputs to inputs (fast) or alternate two state sets (reference).
        threads: onnxruntime intra-op threads (default: onnxruntime's choice).
    """

    def __init__(self, path, inplace: bool = True, threads: int | None = None):
        import onnxruntime as ort
        paths = graph_paths(path, verify=True)
        _need_file(paths["decode"])
        cfg_d, meta = _read_meta(paths["decode"], "decode")
        roles = meta.get("roles", ["decode", "prefill"])  # absent: written before decode-only exports
        others = [r for r in roles if r != "decode"]
        for role in others + ["data"]:
            _need_file(paths[role])
        for role in others:
            if _read_meta(paths[role], role)[1].get("export_id") != meta.get("export_id"):
                raise ExportFormatError(f"{paths[role]} comes from another export than "
                                        f"{paths['decode']} (export ids differ): re-export both")
        config = ShramConfig.from_dict(cfg_d)
        super().__init__(config, meta["batch_size"], meta["prefill_chunk"], meta.get("eos_token_id"))
        self.paths, self.meta, self.inplace = paths, meta, inplace
        self.names = list(meta["state_names"])
        # absent: an export from before rollback support, whose state cannot roll back
        self.rollback_limit = int(meta.get("rollback_limit") or 0)
        self.verify_len = meta.get("verify_len") if "verify" in roles else None
        # absent: written before last-token prefill graphs, whose prefill returned every token's
        self.full_logits = bool(meta.get("full_logits", True)) or "prefill" not in roles
        self._graphs = {role: _Graph(paths[role], threads) for role in roles}
        lengths = meta.get("prefix_lengths") or ()
        self._slots = PrefixSlots(config, lengths) if lengths else None
        for role, g in self._graphs.items():
            if (SLOTS_INPUT in g.inputs) != bool(lengths):
                raise ExportFormatError(
                    f"{paths[role]} {'has no' if lengths else 'takes'} a {SLOTS_INPUT!r} input, but the "
                    f"metadata lists prefix lengths {list(lengths)} (a file from another export?)")
        B, C, V = self.batch_size, self.prefill_chunk, config.vocab_size
        for role, g in self._graphs.items():
            c = {"decode": 1, "prefill": C, "verify": self.verify_len}[role]
            out = [B, 1 if role == "prefill" and not self.full_logits else c, V]
            if g.inputs["input_ids"].shape != [B, c] or list(g.logits.shape) != out:
                raise ExportFormatError(f"{paths[role]} takes input_ids {g.inputs['input_ids'].shape} and "
                                        f"returns logits {list(g.logits.shape)}, but its config says "
                                        f"{[B, c]} -> {out} (a file from another config?)")
        dec_in = self._graphs["decode"].inputs
        self._arrays = [[np.zeros(dec_in[f"past.{n}"].shape, _NP_DTYPES[dec_in[f"past.{n}"].type])
                         for n in self.names] for _ in range(1 if inplace else 2)]
        # OrtValue.ortvalue_from_numpy does not own the array: self._arrays keeps them alive.
        self._state = [[ort.OrtValue.ortvalue_from_numpy(a) for a in arrs] for arrs in self._arrays]
        if inplace:
            for g in self._graphs.values():
                g.bind_state(self.names, self._state[0], self._state[0])

    def _run(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        every = n == self.prefill_chunk and "prefill" in self._graphs and self.full_logits
        return self._on(self._graphs["decode" if n == 1 else "prefill" if every else "verify"],
                        tokens, input_pos, live)

    def _run_last(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        if self.full_logits:  # a prefill graph of every token's logits: keep the last ones
            return super()._run_last(tokens, input_pos, live)
        return self._on(self._graphs["prefill"], tokens, input_pos, live)  # (B, 1, V)

    def _on(self, g: "_Graph", tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        if not self.inplace:
            g.bind_state(self.names, self._state[0], self._state[1])
            self._state.reverse()  # after this run the outputs are the current state
            self._arrays.reverse()
        slots = None if self._slots is None else self._slots(input_pos, tokens.shape[1]).numpy()
        out = g.run(np.ascontiguousarray(tokens.numpy(), dtype=np.int64),
                    np.ascontiguousarray(input_pos.numpy(), dtype=np.int64),
                    np.ascontiguousarray(live.numpy(), dtype=np.bool_), slots)
        return torch.from_numpy(out)

    def _reset_state(self) -> None:
        for arrs in self._arrays:  # not needed (position 0 masks): byte-identical to a fresh decoder
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
        path: `m.onnx` (its siblings are found by name).
        inplace: bind each present output to its past input (default; see `OnnxDecoder`).
        threads: onnxruntime intra-op threads.

    Returns:
        An `OnnxDecoder` (`prefill`, `decode`, `reset`, `generate`).

    Raises:
        FileNotFoundError: a file of the export is missing.
        ExportFormatError: a file is truncated, foreign, or from another export / config.
    """
    return OnnxDecoder(path, inplace=inplace, threads=threads)
