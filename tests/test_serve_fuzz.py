"""Schema-driven fuzzing of the server: `schemathesis` generates requests for every route of the
app's own OpenAPI schema, valid and invalid, and sends them in process (its ASGI transport, no
sockets). Every one is served or refused: no 5xx, every error an OpenAI error object, every
stream well formed; and afterwards a greedy request still returns `generate`'s text."""

import json

import pytest
import torch

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.python import asgi  # noqa: E402

from helpers import tiny_model  # noqa: E402
from shram_static import StaticDecoder  # noqa: E402
from shram_static.serve.app import create_app  # noqa: E402
from shram_static.serve.engine import Engine  # noqa: E402
from shram_static.tokenizer import ByteTokenizer  # noqa: E402

TOK = ByteTokenizer()
# A capacity of 48 tokens bounds every generated request (max_tokens beyond it gets 400), so a
# run of a few hundred requests takes seconds.
CAPACITY = 48
# WHY these settings: the suite runs without hypothesis' pytest plugin (pyproject's addopts);
# derandomize fixes the seed, no database keeps runs independent, and the example count bounds
# the time (about 10 s on the CI machine).
FUZZ = settings(max_examples=150, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck))


def _check(case, response) -> None:
    status, ctype = response.status_code, response.headers.get("content-type", [""])
    ctype = ctype[0] if isinstance(ctype, list) else ctype
    where = f"{case.method} {case.formatted_path} {case.body!r:.300}"
    assert status < 500, (where, status, response.text[:500])
    if status >= 400:
        err = json.loads(response.content)
        assert set(err) == {"error"}, (where, err)
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"], (where, err)
    elif ctype.startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (where, response.text[-300:])
        for e in events[:-1]:
            assert "error" not in json.loads(e), (where, e)


@pytest.fixture(scope="module")
def fuzzed_app():
    model = tiny_model(num_decoder_layers=1, inference_sequence_length=CAPACITY)  # the server under test, not the model
    engine = Engine(lambda: (StaticDecoder(model, batch_size=2, prefill_chunk=8), TOK), max_queue=64)
    app = create_app(engine)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)  # starts the app's lifespan
    try:
        assert engine.wait_ready(60)
        yield model, app, schema, engine
    finally:
        asgi.shutdown_lifespans()  # stops the engine: nothing left running
    assert engine.status == "stopped"


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_generated_request_is_served_or_refused(fuzzed_app, mode):
    model, app, schema, engine = fuzzed_app
    ops = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert ops >= {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                   ("GET", "/health"), ("GET", "/metrics")}
    seen, statuses = set(), {}

    @FUZZ
    @given(case=schema.as_strategy(generation_mode=mode))
    def run(case):
        seen.add((case.method.upper(), case.path))
        response = case.call(timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        _check(case, response)

    run()
    # every route was tried (negative data exists only for the routes that take a body)
    assert seen == (ops if mode == GenerationMode.POSITIVE else {o for o in ops if o[0] == "POST"})
    assert statuses.get(200 if mode == GenerationMode.POSITIVE else 400, 0) >= 20, statuses
    assert engine.status == "ready" and engine.busy_rows == 0


def test_greedy_after_fuzzing_is_generates(fuzzed_app):
    model, app, schema, engine = fuzzed_app
    want = StaticDecoder(model, batch_size=1, prefill_chunk=8).generate(
        torch.tensor([TOK.encode("ROMEO:")]), max_new_tokens=20, eos_token_id=TOK.eos_token_id)[0].tolist()
    want = TOK.decode(want[:want.index(TOK.eos_token_id)] if TOK.eos_token_id in want else want)
    with asgi.get_client(app) as client:
        r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 20, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert client.get("/health").status_code == 200
