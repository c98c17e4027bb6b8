"""Host-side decoding API shared by every backend (eager/compiled torch, ExecuTorch, ONNX).

`HostDecoder` owns everything that happens on the host: input validation (before anything
runs, so a bad call leaves the state exactly as it was), the live-token count of each row,
splitting prompts into fixed-size chunks, and sampling. A backend implements only
`_run(tokens, input_pos, live)` for C = 1 (decode) and C = prefill_chunk (prefill).
"""

import torch
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from .config import ShramConfig
from .model import check_input_ids, check_mask


class CapacityError(ValueError):
    """A row would hold more live tokens than the decoder's capacity."""


class HostDecoder:
    """Public decoding API over a fixed-shape step backend.

    Args:
        config: model config; `inference_sequence_length` is the capacity S per row.
        batch_size: B, rows per call (fixed).
        prefill_chunk: C, tokens per prefill step.
        eos_token_id: id that ends a row in `generate` (None: rows never stop early).
    """

    def __init__(self, config: ShramConfig, batch_size: int, prefill_chunk: int,
                 eos_token_id: int | None = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
        self.config = config
        self.batch_size = batch_size
        self.prefill_chunk = prefill_chunk
        self.capacity = config.inference_sequence_length
        self.eos_token_id = eos_token_id
        self._count = torch.zeros(batch_size, dtype=torch.long)  # live tokens per row

    # -- backend hooks --------------------------------------------------------------
    def _run(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """tokens (B, C) int64, input_pos (B,) int64, live (B, C) bool -> logits (B, C, V)."""
        raise NotImplementedError

    def _reset_state(self) -> None:
        """Optional: clear backend buffers (never needed for correctness)."""

    # -- public API -------------------------------------------------------------------
    @property
    def live_counts(self) -> torch.Tensor:
        """(B,) live tokens each row holds."""
        return self._count.clone()

    def reset(self) -> None:
        """Starts every row afresh (position 0)."""
        self._count.zero_()
        self._reset_state()

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                last_only: bool = False) -> torch.Tensor:
        """Appends tokens to every row and returns their logits.

        Args:
            input_ids: (B, N) token ids, any N >= 1 within capacity; run as ceil(N / C)
                fixed-size chunks, the last padded with dead tokens.
            attention_mask: (B, N) 1 live / 0 dead (dead tokens are no-ops). Default all live.
            last_only: return only each row's logits at its last live token, what generation
                needs (like transformers' `logits_to_keep=1`): the full (B, N, V) tensor of a
                2000-token prompt at batch 4 with a 50k vocabulary is 1.6 GB.

        Returns:
            (B, N, V) float logits (unspecified at dead positions), or (B, V) with `last_only`
            (unspecified for a row without a live token).

        Raises:
            TypeError, ValueError, CapacityError before running anything (state unchanged).
        """
        if not isinstance(last_only, bool):
            raise TypeError(f"last_only must be a bool, got {type(last_only).__name__}")
        ids, live = self._check_prompt(input_ids, attention_mask)
        self._check_capacity(live.long().sum(1))
        B, N = ids.shape
        C, V = self.prefill_chunk, self.config.vocab_size
        pad = (-N) % C
        ids = torch.nn.functional.pad(ids, (0, pad))
        live = torch.nn.functional.pad(live, (0, pad))
        pos = self._count.clone()
        out = []
        last = torch.zeros(B, V)  # (B, V) logits at each row's last live token so far
        rows = torch.arange(B)
        for c0 in range(0, N + pad, C):
            lc = live[:, c0:c0 + C]
            if not bool(lc.any()):  # a chunk of padding only changes nothing
                if not last_only:
                    out.append(torch.zeros(B, C, V))
                continue
            lg = self._call(ids[:, c0:c0 + C], pos, lc).float().cpu()  # (B, C, V)
            if last_only:
                at = (torch.arange(C) * lc).argmax(1)  # last live token of each row in this chunk
                last = torch.where(lc.any(1)[:, None], lg[rows, at], last)
            else:
                out.append(lg)
            pos += lc.long().sum(1)
            self._count = pos.clone()
        return last if last_only else torch.cat(out, dim=1)[:, :N]

    def decode(self, ids: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """Feeds one token per row.

        Args:
            ids: (B,) token ids.
            active: (B,) bool; inactive rows change nothing (their logits are unspecified).

        Returns:
            (B, V) float logits.
        """
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
        if ids.shape != (self.batch_size,):
            raise ValueError(f"ids must have shape ({self.batch_size},) (one token per row), got {tuple(ids.shape)}")
        check_input_ids(ids, self.config.vocab_size, "ids")
        live = check_mask(active, ids.shape, "active")
        live = torch.ones(self.batch_size, dtype=torch.bool) if live is None else live.cpu()
        self._check_capacity(live.long())
        logits = self._call(ids.long().cpu()[:, None], self._count, live[:, None])[:, 0]
        self._count += live.long()
        return logits.float().cpu()

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None,
                 streamer=None) -> torch.Tensor:
        """Resets, prefills the prompt, then decodes new tokens (greedy by default).

        Args:
            input_ids, attention_mask: the prompt, as in `prefill`; every row needs a live token.
            max_new_tokens: n tokens to produce per row.
            do_sample: sample instead of argmax (also implied by temperature/top_k/top_p).
            temperature, top_k, top_p: sampling filters (transformers' logits warpers).
            seed: seeds the sampler for reproducible samples.
            eos_token_id: stops a row once produced (default: the decoder's tokenizer EOS).
            pad_token_id: fills a row after it stopped (default: eos_token_id, else 0).
            streamer: a transformers-style streamer (e.g. `TextStreamer`, batch 1): gets
                `put(prompt ids)`, then `put(tokens (B,))` as each is produced, then `end()`.

        Returns:
            (B, n) int64 new tokens.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        ids, live = self._check_prompt(input_ids, attention_mask)
        n_prompt = live.long().sum(1)
        if bool((n_prompt == 0).any()):
            raise ValueError(f"every row needs at least one live prompt token; rows "
                             f"{torch.nonzero(n_prompt == 0).flatten().tolist()} have none")
        # The last new token is returned, not fed back: n_prompt + n - 1 tokens are held.
        need = n_prompt + max_new_tokens - 1
        if bool((need > self.capacity).any()):
            raise CapacityError(f"prompt plus max_new_tokens - 1 = {need.max().item()} tokens exceed "
                                f"the capacity of {self.capacity} per row (inference_sequence_length)")
        eos = self.eos_token_id if eos_token_id is None else eos_token_id
        pad = pad_token_id if pad_token_id is not None else (eos if eos is not None else 0)
        sample = do_sample or temperature != 1.0 or top_k is not None or top_p is not None
        warp = LogitsProcessorList()
        if temperature != 1.0:
            warp.append(TemperatureLogitsWarper(temperature))
        if top_k is not None:
            warp.append(TopKLogitsWarper(top_k))
        if top_p is not None:
            warp.append(TopPLogitsWarper(top_p))
        gen = torch.Generator().manual_seed(seed) if seed is not None else None

        self.reset()
        logits = self.prefill(ids, live, last_only=True)  # (B, V)
        out = torch.full((self.batch_size, max_new_tokens), pad, dtype=torch.long)
        done = torch.zeros(self.batch_size, dtype=torch.bool)
        if streamer is not None:
            streamer.put(ids)
        for t in range(max_new_tokens):
            if sample:
                probs = torch.softmax(warp(out[:, :t], logits.float()), dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
            else:
                nxt = logits.argmax(-1)
            out[:, t] = torch.where(done, pad, nxt)
            if streamer is not None:
                streamer.put(out[:, t].clone())
            if eos is not None:
                done |= nxt == eos
            if t + 1 == max_new_tokens or bool(done.all()):
                break
            logits = self.decode(torch.where(done, 0, nxt), active=~done)
        if streamer is not None:
            streamer.end()
        return out

    def _call(self, tokens: torch.Tensor, input_pos: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        # Fresh contiguous copies with canonical strides: a compiled step guards on input
        # strides, and a column slice of a one-row prompt keeps the parent's row stride
        # (.contiguous() is a no-op for it), which made every prefill call recompile.
        canon = lambda t: t.clone(memory_format=torch.contiguous_format)
        return self._run(canon(tokens), canon(input_pos), canon(live))

    # -- validation -----------------------------------------------------------------
    def _check_prompt(self, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D (batch, length), got shape {tuple(input_ids.shape)}")
        if input_ids.shape[0] != self.batch_size:
            raise ValueError(f"this decoder was built for batch_size={self.batch_size}, got "
                             f"{input_ids.shape[0]} rows")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty: a prompt needs at least one token")
        check_input_ids(input_ids, self.config.vocab_size)
        live = check_mask(attention_mask, input_ids.shape)
        live = torch.ones(input_ids.shape, dtype=torch.bool) if live is None else live.cpu()
        return input_ids.long().cpu(), live

    def _check_capacity(self, n_new: torch.Tensor) -> None:
        total = self._count + n_new
        if bool((total > self.capacity).any()):
            rows = torch.nonzero(total > self.capacity).flatten().tolist()
            raise CapacityError(f"rows {rows} would hold {total.max().item()} live tokens, more than the "
                                f"capacity of {self.capacity} (inference_sequence_length); call reset() "
                                f"or build the model with a larger inference_sequence_length")
