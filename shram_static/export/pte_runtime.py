"""Runs a `.pte` written by `export_pte` behind the `StaticDecoder` API (`PteDecoder`, `load_pte`).
Imports only the ExecuTorch runtime (inside `PteDecoder`), never the exporter."""

import contextlib
import json
import os

import torch

from ..config import ShramConfig
from ..errors import ExportFormatError
from ..host import HostDecoder
from ..state import PrefixSlots
from .common import PTE_FORMAT, PTE_MAGIC


@contextlib.contextmanager
def torch_threads(n: int):
    """Runs the block with `torch.set_num_threads(n)`, restoring the previous count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _read_constant(program, name: str, path: str):
    if name not in program.method_names:
        raise ExportFormatError(f"{path} has no {name!r} method: it was not written by "
                                f"shram_static.export.export_pte")
    return program.load_method(name).execute([])[0]


class PteDecoder(HostDecoder):
    """`HostDecoder` over an ExecuTorch program written by `export_pte` (build it with `load_pte`).

    The step methods run through `executorch.runtime`'s Program, which shares their state buffers.

    Args:
        path: the `.pte` file.
    """

    def __init__(self, path):
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"ExecuTorch program {path!r} does not exist")
        with open(path, "rb") as f:
            head = f.read(8)
        if len(head) < 8 or head[4:8] != PTE_MAGIC:
            raise ExportFormatError(f"{path} is not an ExecuTorch program (no {PTE_MAGIC!r} header)")
        from executorch.runtime import Runtime

        from .. import accelerators
        accelerators.share_packed_weights()  # one packed copy of each weight for all methods (where verified)
        try:
            program = Runtime.get().load_program(path)
        except Exception as e:  # the runtime raises a bare RuntimeError on a bad flatbuffer
            raise ExportFormatError(f"{path} could not be loaded by the ExecuTorch runtime "
                                    f"(truncated or corrupt?): {e}") from e
        try:
            meta = json.loads(_read_constant(program, "get_shram_export", path))
            config = ShramConfig.from_dict(json.loads(_read_constant(program, "get_shram_config", path)))
        except ExportFormatError:
            raise
        except Exception as e:
            raise ExportFormatError(f"{path}: unreadable shram metadata (truncated or corrupt?): {e}") from e
        if meta.get("format") != PTE_FORMAT:
            raise ExportFormatError(f"{path} has format {meta.get('format')!r}; this version reads {PTE_FORMAT!r}")
        super().__init__(config, meta["batch_size"], meta["prefill_chunk"], meta.get("eos_token_id"))
        self.path, self.meta, self._program = path, meta, program
        B, C, V = self.batch_size, self.prefill_chunk, config.vocab_size
        # absent: written before last-token prefill methods, whose prefill returned every token's
        self.full_logits = bool(meta.get("full_logits", True)) or meta["prefill_method"] is None
        self._check_signature(meta["decode_method"], (B, 1), (B, V))
        if meta["prefill_method"] is not None:
            self._check_signature(meta["prefill_method"], (B, C), (B, C if self.full_logits else 1, V))
        # absent: a file written before rollback support, whose state cannot roll back
        self.rollback_limit = int(meta.get("rollback_limit") or 0)
        self.verify_len = meta.get("verify_len")
        verify = "verify" if meta.get("verify_method") == "verify" else None
        if verify:
            self._check_signature("verify", (B, self.verify_len), (B, self.verify_len, V))
        try:
            # Decode first: it carries the state's starting values (see `pte._init_first_method_pass`).
            self._decode, self._prefill, self._verify = (
                None if name is None else program.load_method(name)
                for name in (meta["decode_method"], meta["prefill_method"], verify))
        except Exception as e:
            raise ExportFormatError(f"{path}: loading the step methods failed (truncated, or built "
                                    f"with kernels this runtime lacks?): {e}") from e
        # At batch 1 the decode step with slots is `decode` beside the stock runner's `forward`.
        takes = set(meta.get("slots_methods", ()))
        if meta["decode_method"] == "forward" and "decode" in takes:
            self._check_signature("decode", (B, 1), (B, V))
            self._forward = self._decode  # kept loaded: the shared state's first method
            try:
                self._decode = program.load_method("decode")
            except Exception as e:
                raise ExportFormatError(f"{path}: loading the decode method failed: {e}") from e
            meta = {**meta, "decode_method": "decode"}
        self._batched = meta["decode_method"] != "forward"
        steps = {"decode": self._decode, "prefill": self._prefill, "verify": self._verify}
        self._slots_methods = {id(m) for name, m in steps.items() if m is not None and name in takes}
        self._slots = PrefixSlots(config, meta["prefix_lengths"]) if self._slots_methods else None

    def _check_signature(self, method: str, tokens_shape, logits_shape) -> None:
        if method not in self._program.method_names:
            raise ExportFormatError(f"{self.path} has no {method!r} method")
        mm = self._program.metadata(method)
        got_in = tuple(mm.input_tensor_meta(0).sizes())
        got_out = tuple(mm.output_tensor_meta(0).sizes())
        if got_in != tuple(tokens_shape) or got_out != tuple(logits_shape):
            raise ExportFormatError(
                f"{self.path}: method {method!r} takes tokens {got_in} and returns logits {got_out}, "
                f"but its stored config says {tuple(tokens_shape)} -> {tuple(logits_shape)} "
                f"(a file from another config?)")

    @property
    def method_names(self) -> set[str]:
        """Every method in the program (steps and constants)."""
        return set(self._program.method_names)

    def _run(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        # The runtime rejects strided inputs (e.g. a column slice of the prompt).
        tokens, input_pos, live = tokens.contiguous(), input_pos.contiguous(), live.contiguous()
        # WHY one torch thread: else torch's OpenMP worker spin-waits on a core XNNPACK's
        # threadpool needs (docs/performance.md, "`.pte`").
        with torch_threads(1):
            return self._execute(tokens, input_pos, live)

    def _run_last(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        if self.full_logits:  # a prefill method of every token's logits: keep the last ones
            return super()._run_last(tokens, input_pos, live)
        with torch_threads(1):  # as in _run
            return self._with_slots(self._prefill, tokens.contiguous(), input_pos.contiguous(), live.contiguous())

    def _with_slots(self, method, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        args = [tokens, input_pos, live]
        if id(method) in self._slots_methods:  # ids of this decoder's own methods, held as attributes
            args.append(self._slots(input_pos, tokens.shape[1]))
        return method.execute(args)[0]

    def _execute(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] == 1:
            if self._batched:
                out = self._with_slots(self._decode, tokens, input_pos, live)
            elif bool(live.all()):
                out = self._decode.execute([tokens, input_pos])[0]
            else:
                # `forward` (stock-runner signature) has no live flag: a dead token of a batch-1
                # decode is a no-op, so skip the call (its logits are unspecified).
                out = torch.zeros(1, self.config.vocab_size)
            return out[:, None, :]
        every = tokens.shape[1] == self.prefill_chunk and self._prefill is not None and self.full_logits
        return self._with_slots(self._prefill if every else self._verify, tokens, input_pos, live)


def load_pte(path) -> PteDecoder:
    """Loads a `.pte` written by `export_pte` as a decoder with the `StaticDecoder` API.

    Args:
        path: the `.pte` file; everything else (config, batch size, chunk) is read from it.

    Returns:
        A `PteDecoder` (`prefill`, `decode`, `reset`, `generate`).

    Raises:
        FileNotFoundError: no such file.
        ExportFormatError: not a (complete) program written by `export_pte`.
    """
    return PteDecoder(path)
