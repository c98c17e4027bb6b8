"""Continuous batching on the static state: one background thread owns the decoder, each of its B
rows serves one request, and each iteration runs ONE fixed-shape step (`HostDecoder.step`). An error
in one request's own work ends it alone; an error of the step fails them all (docs/serving.md)."""

import collections
import contextlib
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import NonFiniteLogitsError
from ..sampling import Sampler
from ..speculative import steady
from .metrics import Metrics
from .text import TextStream


class QueueFull(RuntimeError):
    """The waiting queue holds `max_queue` requests already."""


class NotReady(RuntimeError):
    """The model is still loading or compiling (or failed to)."""


@dataclass
class Event:
    """What one step produced for one request (through `Job.sink`): `text` ('' when held back), new
    `tokens`, their `logprobs` when asked for ((logprob, {id: logprob} of the top ones) per token),
    `finish_reason` (None while running, then "stop", "length", "cancelled" or "error"), `error`."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Job:
    """One generation request: validated `prompt` ids, `max_tokens` (None: to the row's capacity),
    `sampling.Sampler`'s settings, `seed` (None: random), `stop` strings, `logprobs` (top logprobs per
    token of the raw logits; None: none), `sink` (called from the engine thread; must not block)."""

    prompt: list[int]
    sink: Callable[[Event], None]
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    cancelled: bool = False
    tokens: list[int] = field(default_factory=list)  # every sampled token (EOS included)
    t_submit: float = field(default_factory=time.perf_counter)
    t_last: float = 0.0  # when its latest token was sampled

    def cancel(self) -> None:
        """Asks the engine to drop this request (its row is freed before the next step)."""
        self.cancelled = True


class _Row:
    """A request in a row: prompt tokens fed, the next token to feed, its sampler and seen tokens."""

    def __init__(self, job: Job, tokenizer, vocab_size: int):
        self.job, self.fed = job, 0
        self.next: int | None = None  # sampled, not yet fed
        self.text = TextStream(tokenizer, job.stop, tokenizer.eos_token_id)
        self.sampler = Sampler(job.temperature, job.top_k, job.top_p, logit_bias=job.logit_bias,
                               presence_penalty=job.presence_penalty, frequency_penalty=job.frequency_penalty,
                               repetition_penalty=job.repetition_penalty, vocab_size=vocab_size)
        self.seen = self.sampler.history(torch.tensor([job.prompt]), None, vocab_size)
        # unseeded: from the OS (torch's global generator starts from the same seed every run)
        seed = job.seed if job.seed is not None else secrets.randbits(63)
        self.gen = torch.Generator().manual_seed(seed)


class Engine:
    """Runs requests on the B rows of one decoder, in a background thread.

    Args:
        load: called once in the engine thread; returns (decoder: a `HostDecoder`, tokenizer).
        max_queue: most requests waiting while every row is busy (`submit` raises `QueueFull` beyond).
        warmup: run both step shapes once (dead tokens) before ready: a compiled decoder compiles then.
        long_prompt: prompt tokens left from which a joining row gets prefill-shape steps (default: 4 chunks).
    """

    def __init__(self, load: Callable, max_queue: int = 64, warmup: bool = True,
                 long_prompt: int | None = None):
        self._load, self.max_queue, self.warmup, self._long_prompt = load, max_queue, warmup, long_prompt
        self.status = "loading"  # -> "compiling" -> "ready" (or "failed"), then "stopped"
        self.error: str | None = None
        self.decoder = self.tokenizer = None
        self.metrics = Metrics()
        self._pending: collections.deque[Job] = collections.deque()
        self._rows: list[_Row | None] = []
        self._cv = threading.Condition()
        self._stop = self._draining = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="shram-static-engine", daemon=True)

    def start(self) -> "Engine":
        """Starts the engine thread (loading the model there); returns self."""
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Blocks until the model is ready or failed (or `timeout` s passed); True when ready."""
        self._ready.wait(timeout)
        return self.status == "ready"

    def stop(self, timeout: float | None = 30) -> None:
        """Cancels every queued and running request and ends the thread."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def drain(self, timeout: float) -> None:
        """Cancels the queued requests, lets running rows finish for `timeout` s, then `stop`s."""
        with self._cv:
            self._draining = True
            jobs = list(self._pending)
            self._pending.clear()
        for job in jobs:
            self._end(job, "cancelled")
        end = time.monotonic() + timeout
        while self.busy_rows and time.monotonic() < end and self._thread.is_alive():
            time.sleep(0.01)
        self.stop()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    @property
    def capacity(self) -> int:
        return self.decoder.capacity

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def busy_rows(self) -> int:
        return sum(r is not None for r in self._rows)

    def submit(self, job: Job) -> Job:
        """Queues a validated request (FIFO) for the next free row; returns it.

        Raises:
            NotReady: the model is not loaded and compiled yet.
            QueueFull: every row is busy and `max_queue` requests wait for one already.
        """
        with self._cv:
            if self._stop or self._draining:
                raise NotReady("the server is shutting down")
            if self.status != "ready":
                raise NotReady(self.error or f"the model is {self.status}")
            # the queued requests take the free rows first: only those beyond count against max_queue
            free = sum(r is None for r in self._rows)
            if len(self._pending) >= self.max_queue + free:
                self.metrics.observe_rejected()
                raise QueueFull(f"every row is busy and {self.max_queue} requests wait for one already "
                                f"(--max-queue)")
            self._pending.append(job)
            self._cv.notify()
        return job

    def _main(self) -> None:
        try:
            self.decoder, self.tokenizer = self._load()
            if self.warmup:
                self.status = "compiling"
                self.decoder.warm_up(("decode", "prefill_last"))  # dead tokens only: no row changes
            self._rows = [None] * self.decoder.batch_size
            if self._long_prompt is None:
                self._long_prompt = 4 * self.decoder.prefill_chunk
            self.status = "ready"
        except Exception as e:  # reported by /health until the server exits
            self._fail(f"the model could not be loaded: {type(e).__name__}: {e}")
            return
        self._ready.set()
        try:
            # the engine's own decoder: no code changes its weights while it serves, so each kind
            # of step checks them once (`StaticDecoder.steady`), not on every step
            with steady([self.decoder]):
                while self._iterate():
                    pass
        except Exception as e:  # the step failed for all rows: every request is told, nothing hangs
            self._fail(f"the model's step failed: {type(e).__name__}: {e}")
            return
        self._finish_all("cancelled")
        self.status = "stopped"

    def _fail(self, error: str) -> None:
        """The engine cannot serve any more: every request ends with `error`."""
        with self._cv:
            self.status, self.error = "failed", error
        self._ready.set()
        self._finish_all("error", error)

    def _finish_all(self, reason: str, error: str | None = None) -> None:
        with self._cv:
            jobs = [r.job for r in self._rows if r is not None] + list(self._pending)
            self._rows = [None] * len(self._rows)
            self._pending.clear()
        for job in jobs:
            self._end(job, reason, error=error)

    def _iterate(self) -> bool:
        """Admits waiting requests, drops cancelled ones, runs one step; False once stopped."""
        rows = self._rows
        with self._cv:
            while not self._stop and not self._pending and all(r is None for r in rows):
                self._cv.wait()
            if self._stop:
                return False
            for b, r in enumerate(rows):
                if r is not None and r.job.cancelled:
                    rows[b] = None
                    self._end(r.job, "cancelled")
            for job in [job for job in self._pending if job.cancelled]:  # gone before getting a row
                self._pending.remove(job)
                self._end(job, "cancelled")
            while self._pending and None in rows:
                job = self._pending.popleft()
                try:
                    row = _Row(job, self.tokenizer, self.decoder.config.vocab_size)
                except Exception as e:  # this request's own settings: it alone ends
                    self._end(job, "error", error=f"{type(e).__name__}: {e}")
                    continue
                b = rows.index(None)
                rows[b] = row
                self.decoder.reset_rows(b)
                self.metrics.observe_admit(len(job.prompt), time.perf_counter() - job.t_submit, len(self._pending))
        if any(r is not None for r in rows):
            self._step()
        return True

    def _step(self) -> None:
        dec, rows = self.decoder, self._rows
        B, C = dec.batch_size, dec.prefill_chunk
        running = [b for b, r in enumerate(rows) if r is not None and r.next is not None]
        joining = [b for b, r in enumerate(rows) if r is not None and r.next is None]
        left = [len(rows[j].job.prompt) - rows[j].fed for j in joining]
        # prefill shape when no row decodes (it stalls nobody) or for a long prompt, else a token a step
        W = C if joining and (not running or max(left) >= self._long_prompt) else 1
        ids = torch.zeros(B, W, dtype=torch.long)
        live = torch.zeros(B, W, dtype=torch.bool)
        for b in running:
            ids[b, 0], live[b, 0] = rows[b].next, True
        # every joining row's next chunk rides in the same step: all B x W tokens are computed anyway
        chunks = {j: rows[j].job.prompt[rows[j].fed:rows[j].fed + W] for j in joining}
        for j, chunk in chunks.items():
            ids[j, :len(chunk)] = torch.tensor(chunk)
            live[j, :len(chunk)] = True
        t0 = time.perf_counter()
        # (B, 1, V) at each row's last live token; any other error leaves the state unknown: `_main` ends all
        bad = {}
        try:
            logits = dec.step(ids, live, last_only=True)
        except NonFiniteLogitsError as e:  # the step ran; only these rows' logits are bad
            if e.logits is None:
                raise
            logits = e.logits.float().cpu()
            bad = {b: "the model produced NaN or Inf logits for this request" for b in e.rows}
        dt = time.perf_counter() - t0
        out = {b: logits[b, 0] for b in running}  # row -> (V,) logits of its next token
        for j, chunk in chunks.items():
            rows[j].fed += len(chunk)
            if rows[j].fed == len(rows[j].job.prompt):
                out[j] = logits[j, 0]
        self.metrics.observe_step("prefill" if W > 1 else "decode", dt, len(running) + len(joining), B)
        for b in sorted(set(out) | set(bad)):
            r = rows[b]
            try:
                if b in bad:
                    raise RuntimeError(bad[b])
                self._advance(b, out[b])
            except Exception as e:  # this request's own work failed: it alone ends, its row freed
                if rows[b] is r:
                    rows[b] = None
                    self._end(r.job, "error", error=str(e) if b in bad else f"{type(e).__name__}: {e}")

    def _advance(self, b: int, logits: torch.Tensor) -> None:
        """Samples row b's next token from its (V,) logits and tells the request."""
        r = self._rows[b]
        job = r.job
        lg = logits.float()[None]  # (1, V)
        # as HostDecoder.generate samples a batch-1 row, with this request's own generator
        tok = int(r.sampler.sample(lg, r.gen, r.seen)[0])
        if r.seen is not None:
            r.seen.add(torch.tensor([tok]))
        now = time.perf_counter()
        self.metrics.observe_token(not job.tokens, now - (job.t_last if job.tokens else job.t_submit))
        job.t_last = now
        job.tokens.append(tok)
        lp = None
        if job.logprobs is not None:
            logp = torch.log_softmax(lg[0], -1)
            top = torch.topk(logp, min(job.logprobs, logp.shape[-1])) if job.logprobs else None
            lp = [(float(logp[tok]), {int(i): float(v) for v, i in zip(*top)} if top else {})]
        text = r.text.push(tok)
        n = len(job.tokens)
        finish = None
        if r.text.stopped:
            finish = "stop"
        elif (job.max_tokens is not None and n >= job.max_tokens) or len(job.prompt) + n > self.capacity:
            finish = "length"  # max_tokens, or feeding this token would pass the row's capacity
            text += r.text.flush()
        if finish is None:
            r.next = tok
            try:
                job.sink(Event(text, [tok], lp))
            except Exception:  # the client's event loop is gone: free the row next iteration
                job.cancel()
            return
        self._rows[b] = None
        self._end(job, finish, text, [tok], lp)

    def _end(self, job: Job, reason: str, text: str = "", tokens=None, lp=None, error=None) -> None:
        self.metrics.observe_finish(reason, time.perf_counter() - job.t_submit)
        with contextlib.suppress(Exception):  # a sink whose client is gone: nothing left to tell
            job.sink(Event(text, tokens or [], lp, reason, error))
