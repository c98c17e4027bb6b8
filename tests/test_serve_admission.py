"""Admission by free rows: with B rows and `--max-queue q`, B + q simultaneous requests are all
served, and only those beyond get 429; a request waits only while every row is busy.

Concurrent `openai` clients talk to a live server on 127.0.0.1 whose decoder's step can be
held at a gate, so the engine cannot move requests into rows while they arrive (the race the
count must not depend on). Every wait is bounded and the gate is always reopened."""

import concurrent.futures
import contextlib
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from helpers import tiny_model  # noqa: E402
from shram_static import StaticDecoder  # noqa: E402
from shram_static.serve.app import BUILTIN_NAME, create_app  # noqa: E402
from shram_static.serve.engine import Engine  # noqa: E402
from shram_static.serve.server import ServerThread  # noqa: E402
from shram_static.tokenizer import ByteTokenizer  # noqa: E402

B, Q = 2, 2  # rows, --max-queue
LIMIT_S = 60


class Gated:
    """A decoder whose `step` waits while `gate` is closed (everything else is the decoder's)."""

    def __init__(self, dec, gate: threading.Event):
        self._dec, self._gate = dec, gate
        self.held = []  # per step: whether it ran in the decoder's steady window

    def __getattr__(self, name):
        return getattr(self._dec, name)

    def step(self, *args, **kw):
        assert self._gate.wait(LIMIT_S), "the test left the gate closed"
        self.held.append(self._dec._held is not None)
        return self._dec.step(*args, **kw)


@pytest.fixture(scope="module")
def server():
    """(url, engine, gate) of a B-row server with --max-queue Q (the gate open)."""
    gate = threading.Event()
    gate.set()
    model = tiny_model(inference_sequence_length=1024)
    engine = Engine(lambda: (Gated(StaticDecoder(model, batch_size=B, prefill_chunk=8), gate), ByteTokenizer()),
                    max_queue=Q)
    with ServerThread(create_app(engine), shutdown_timeout=1) as url:
        assert engine.wait_ready(LIMIT_S)
        try:
            yield url, engine, gate
        finally:
            gate.set()


@contextlib.contextmanager
def closed(gate: threading.Event):
    gate.clear()
    try:
        yield
    finally:
        gate.set()


def _wait(cond, what):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < LIMIT_S, what
        time.sleep(0.01)


def _ask(url, max_tokens=4):
    """One completion through the openai client: its status (200, or 429 from RateLimitError)."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=LIMIT_S)
    try:
        r = c.completions.create(model=BUILTIN_NAME, prompt="ROMEO:", max_tokens=max_tokens, temperature=0)
    except openai.RateLimitError:
        return 429
    assert r.usage.completion_tokens == max_tokens
    return 200


def test_idle_server_serves_rows_plus_queue_at_once(server):
    """B + q simultaneous requests to an idle server are all served (the engine held while they
    arrive, so none has taken a row yet); the next one gets 429."""
    url, engine, gate = server
    with concurrent.futures.ThreadPoolExecutor(B + Q) as pool:
        with closed(gate):
            futures = [pool.submit(_ask, url) for _ in range(B + Q)]
            _wait(lambda: engine.queue_depth + engine.busy_rows == B + Q, "the requests did not arrive")
            assert _ask(url) == 429
        assert [f.result(LIMIT_S) for f in futures] == [200] * (B + Q)
    _wait(lambda: engine.busy_rows == 0 and engine.queue_depth == 0, "rows were not freed")


def test_busy_server_queues_q_then_refuses(server):
    """With every row busy (long streams), q more requests wait and are served once rows free;
    the one beyond gets 429 with Retry-After."""
    url, engine, gate = server
    # 1000 tokens, never EOS: far from done while the test runs
    body = {"prompt": "ROMEO:", "max_tokens": 1000, "temperature": 0, "stream": True, "logit_bias": {"257": -100}}
    with httpx.Client(timeout=LIMIT_S) as h, contextlib.ExitStack() as streams:
        for _ in range(B):
            assert streams.enter_context(h.stream("POST", f"{url}/v1/completions", json=body)).status_code == 200
        _wait(lambda: engine.busy_rows == B, "the streams did not take every row")
        with concurrent.futures.ThreadPoolExecutor(Q) as pool:
            with closed(gate):  # the streams stay in their rows
                futures = [pool.submit(_ask, url) for _ in range(Q)]
                _wait(lambda: engine.queue_depth == Q, "the requests did not queue")
                over = h.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert over.status_code == 429 and over.headers["Retry-After"] == "1"
                assert "every row is busy" in over.json()["error"]["message"]
                streams.close()  # the long streams go away: their rows serve the queued requests
            assert [f.result(LIMIT_S) for f in futures] == [200] * Q
    _wait(lambda: engine.busy_rows == 0 and engine.queue_depth == 0, "rows were not freed")


def test_engine_steps_in_the_decoders_steady_window(server):
    """Nothing changes the engine's own decoder's weights while it serves: every step runs in
    `StaticDecoder.steady`, so a compiled decoder checks its weights once per kind of step."""
    url, engine, _ = server
    assert _ask(url) == 200
    assert engine.decoder.held and all(engine.decoder.held)
