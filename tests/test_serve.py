"""`shram-static serve` against real clients: the `openai` package and raw HTTP (httpx) talk to a
live uvicorn server on 127.0.0.1 (a free port, in a thread of this process, always shut down).

Every served text is checked against `HostDecoder.generate` of the same request alone on a
batch-1 decoder, while other requests of other lengths share the batch-4 server."""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from shram_static import StaticDecoder  # noqa: E402
from shram_static.default_model import default_model  # noqa: E402
from shram_static.serve.app import BUILTIN_NAME, attach_chat_template, create_app  # noqa: E402
from shram_static.serve.server import ServerThread  # noqa: E402
from shram_static.serve.engine import Engine  # noqa: E402
from shram_static.serve.text import TextStream  # noqa: E402
from shram_static.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402

B, C = 4, 8  # rows, prefill chunk (prompts up to ~30 bytes: several chunks)
TOK = ByteTokenizer()
EOS = TOK.eos_token_id
LIMIT_S = 60  # every wait below is bounded


@pytest.fixture(scope="module")
def model():
    return default_model()


@pytest.fixture(scope="module")
def server(model):
    """(base URL, engine) of an eager batch-4 server of the built-in model."""
    engine = Engine(lambda: (StaticDecoder(model, batch_size=B, prefill_chunk=C), TOK), max_queue=32)
    with ServerThread(create_app(engine), shutdown_timeout=1) as url:
        assert engine.wait_ready(LIMIT_S)
        yield url, engine


@pytest.fixture(scope="module")
def solo(model):
    """The reference: `generate` on a batch-1 decoder, one request alone.
    Returns (text, completion tokens, finish_reason)."""
    dec = StaticDecoder(model, batch_size=1, prefill_chunk=C)

    def run(prompt, max_tokens: int, temperature: float = 0.0, top_p: float | None = None,
            seed: int | None = None):
        kw = dict(do_sample=True, temperature=temperature, top_p=top_p, seed=seed) if temperature else {}
        ids = TOK.encode(prompt) if isinstance(prompt, str) else prompt
        out = dec.generate(torch.tensor([ids]), max_new_tokens=max_tokens,
                           eos_token_id=EOS, **kw)[0].tolist()
        if EOS in out:
            return TOK.decode(out[:out.index(EOS)]), out.index(EOS) + 1, "stop"
        return TOK.decode(out), max_tokens, "length"
    return run


def client(url, key="unused", **kw):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=LIMIT_S, **kw)


# (prompt, max_tokens, temperature, top_p, seed): different prompt and output lengths
REQUESTS = [
    ("ROMEO:", 24, 0.0, None, None),
    ("First Citizen:\nBefore we proceed", 9, 0.0, None, None),
    ("O", 31, 0.0, None, None),
    ("KING HENRY:\nWhat say you, my lord", 17, 0.0, None, None),
    ("JULIET:\nWherefore", 40, 0.8, 0.9, 1234),
    ("Nay, ", 12, 0.0, None, None),
    ("What light through yonder", 28, 1.0, None, 7),
    ("HAMLET:", 20, 0.0, None, None),
]


def test_concurrent_requests_match_generate_alone(server, solo):
    """8 requests of different lengths (greedy and seeded sampled, streamed and not) at once on
    4 rows: each gets exactly the text `generate` gives it alone."""
    url, engine = server
    c = client(url)

    def ask(i):
        prompt, n, temp, top_p, seed = REQUESTS[i]
        kw = dict(model=BUILTIN_NAME, prompt=prompt, max_tokens=n, temperature=temp, seed=seed)
        if top_p is not None:
            kw["top_p"] = top_p
        if i % 2:  # streamed
            chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            return text, chunks[-1].usage.completion_tokens, finish
        r = c.completions.create(**kw)
        return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        got = list(pool.map(ask, range(len(REQUESTS))))
    for (prompt, n, temp, top_p, seed), g in zip(REQUESTS, got):
        assert g == solo(prompt, n, temp, top_p, seed), prompt
    assert engine.busy_rows == 0 and engine.queue_depth == 0


def test_stop_string_and_echo(server, solo):
    url, _ = server
    c = client(url)
    full, _, _ = solo("ROMEO:", 30)
    stop = full[10:12]  # a stop string the continuation reaches
    want = full[:full.index(stop)]
    r = c.completions.create(model=BUILTIN_NAME, prompt="ROMEO:", max_tokens=30, temperature=0, stop=[stop, "zzz"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = list(c.completions.create(model=BUILTIN_NAME, prompt="ROMEO:", max_tokens=30, temperature=0,
                                       stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want
    r = c.completions.create(model=BUILTIN_NAME, prompt="Grüße, ", max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == "Grüße, " + solo("Grüße, ", 5)[0]


def test_raw_sse_stream_format(server, solo):
    """OpenAI's server-sent events: data: chunks, the usage chunk with no choices, [DONE]."""
    url, _ = server
    body = {"prompt": "ROMEO:", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=LIMIT_S) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 6
    assert all(o["object"] == "text_completion" and o["usage"] is None for o in objs[:-1])
    assert [o["choices"][0]["finish_reason"] for o in objs[:-1]][-1] == "length"
    assert "".join(o["choices"][0]["text"] for o in objs[:-1]) == solo("ROMEO:", 6)[0]


def test_text_never_splits_a_character():
    """Byte tokens of multi-byte characters are released only once the character is whole."""
    ts = TextStream(TOK, stop=["€"], eos_token_id=EOS)
    data = "añ😀b€c".encode()
    deltas = [ts.push(b) for b in data]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "añ😀b" and ts.stopped
    assert [d for d in deltas if d] == ["a", "ñ", "😀", "b"]


def _bad(url, body, path="/v1/completions", headers=None):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{url}{path}", content=content, timeout=LIMIT_S,
                   headers={"content-type": "application/json", **(headers or {})})
    return r.status_code, r.json()


P = {"prompt": "ROMEO:", "max_tokens": 4}
MSGS = [{"role": "user", "content": "hi"}]
BAD = {  # name: (body, path, the field the error names)
    "malformed_json": (b'{"prompt": "x",', "/v1/completions", None),
    "not_an_object": ([1, 2], "/v1/completions", None),
    "missing_prompt": ({"max_tokens": 4}, "/v1/completions", "prompt"),
    "prompt_wrong_type": ({"prompt": 5}, "/v1/completions", "prompt"),
    "max_tokens_string": ({**P, "max_tokens": "10"}, "/v1/completions", "max_tokens"),
    "max_tokens_negative": ({**P, "max_tokens": -3}, "/v1/completions", "max_tokens"),
    "max_tokens_zero": ({**P, "max_tokens": 0}, "/v1/completions", "max_tokens"),
    "max_tokens_huge": ({**P, "max_tokens": 10**9}, "/v1/completions", "max_tokens"),
    "temperature_string": ({**P, "temperature": "hot"}, "/v1/completions", "temperature"),
    "temperature_range": ({**P, "temperature": 3}, "/v1/completions", "temperature"),
    "top_p_zero": ({**P, "top_p": 0}, "/v1/completions", "top_p"),
    "stream_not_bool": ({**P, "stream": "yes"}, "/v1/completions", "stream"),
    "seed_float": ({**P, "seed": 1.5}, "/v1/completions", "seed"),
    "stop_wrong_type": ({**P, "stop": 3}, "/v1/completions", "stop"),
    "n_two": ({**P, "n": 2}, "/v1/completions", "n"),
    "logprobs_range": ({**P, "logprobs": 9}, "/v1/completions", "logprobs"),
    "prompt_too_long": ({**P, "prompt": "x" * 1100}, "/v1/completions", "prompt"),
    "ids_out_of_vocab": ({**P, "prompt": [1, 2, 259]}, "/v1/completions", "prompt"),
    "ids_negative": ({**P, "prompt": [-1]}, "/v1/completions", "prompt"),
    "ids_empty": ({**P, "prompt": []}, "/v1/completions", "prompt"),
    "two_prompts": ({**P, "prompt": ["a", "b"]}, "/v1/completions", "prompt"),
    "unknown_model": ({**P, "model": "gpt-4"}, "/v1/completions", "model"),
    "chat_no_template": ({"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions", "messages"),
    "chat_no_messages": ({"messages": []}, "/v1/chat/completions", "messages"),
    # OpenAI fields this server does not serve, and fields OpenAI does not define
    "best_of_two": ({**P, "best_of": 2}, "/v1/completions", "best_of"),
    "suffix": ({**P, "suffix": "!"}, "/v1/completions", "suffix"),
    "unknown_field": ({**P, "min_p": 0.1}, "/v1/completions", "min_p"),
    "unknown_nested_field": ({**P, "stream_options": {"include_obfuscation": True}}, "/v1/completions",
                             "stream_options"),
    "echo_logprobs": ({**P, "echo": True, "logprobs": 1}, "/v1/completions", "echo"),
    "bias_out_of_vocab": ({**P, "logit_bias": {"259": 1}}, "/v1/completions", "logit_bias"),
    "bias_not_an_id": ({**P, "logit_bias": {"a": 1}}, "/v1/completions", "logit_bias"),
    "bias_range": ({**P, "logit_bias": {"65": 101}}, "/v1/completions", "logit_bias"),
    "presence_range": ({**P, "presence_penalty": 2.5}, "/v1/completions", "presence_penalty"),
    "frequency_string": ({**P, "frequency_penalty": "1"}, "/v1/completions", "frequency_penalty"),
    "repetition_zero": ({**P, "repetition_penalty": 0}, "/v1/completions", "repetition_penalty"),
    **{f"chat_{k}": ({"messages": MSGS, k: v}, "/v1/chat/completions", k) for k, v in [
        ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
        ("functions", [{"name": "f"}]), ("function_call", "auto"), ("response_format", {"type": "json_object"}),
        ("audio", {"voice": "alloy", "format": "mp3"}), ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}),
        ("reasoning_effort", "low"), ("verbosity", "low"), ("store", True), ("service_tier", "flex"),
        ("n", 2), ("top_logprobs", 2), ("logprobs", 1)]},
}


def test_bad_inputs_get_400_naming_the_field_and_disturb_nobody(server, solo):
    url, engine = server
    c = client(url)
    bystander = concurrent.futures.ThreadPoolExecutor(1).submit(
        lambda: "".join(ch.choices[0].text for ch in c.completions.create(
            model=BUILTIN_NAME, prompt="HAMLET:", max_tokens=40, temperature=0, stream=True)))
    for name, (body, path, param) in BAD.items():
        status, err = _bad(url, body, path)
        assert status == 400, (name, err)
        assert set(err["error"]) >= {"message", "type", "param", "code"}, name
        assert err["error"]["param"] == param, (name, err)
        assert err["error"]["message"], name
    assert "chat template" in _bad(url, *BAD["chat_no_template"][:2])[1]["error"]["message"]
    for name in ("best_of_two", "suffix", "chat_tools", "chat_store", "chat_response_format"):
        assert "is not supported" in _bad(url, *BAD[name][:2])[1]["error"]["message"], name
    assert "unrecognized request field 'min_p'" in _bad(url, *BAD["unknown_field"][:2])[1]["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="nope", prompt="x", max_tokens=2)
    assert bystander.result(LIMIT_S) == solo("HAMLET:", 40)[0]
    assert httpx.get(f"{url}/health").status_code == 200


def test_json_without_content_type_is_served(server, solo):
    """A JSON body without a Content-Type is read as JSON (as llama.cpp's server reads it); a
    body of another declared type gets 415 naming the type expected."""
    url, _ = server
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 5, "temperature": 0}).encode()
    r = httpx.post(f"{url}/v1/completions", content=body, timeout=LIMIT_S)
    assert "content-type" not in r.request.headers
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == solo("ROMEO:", 5)[0]
    r = httpx.post(f"{url}/v1/completions", content=body, timeout=LIMIT_S, headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]


def _metric(url, name, **labels):
    """The value of one sample of /metrics, as prometheus_client's parser reads it."""
    text = httpx.get(f"{url}/metrics", timeout=LIMIT_S).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == {"model": BUILTIN_NAME, **labels}:
                return s.value
    raise KeyError(name)


def _wait(cond, what, every=0.02):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < LIMIT_S, what
        time.sleep(every)


def test_client_disconnect_cancels_its_row(server):
    url, engine = server
    key = dict(name="shram_requests_total", finish_reason="cancelled")
    before = _metric(url, **key)
    body = {"prompt": "ROMEO:", "max_tokens": 500, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=LIMIT_S) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)  # a few tokens in: the row is decoding
        tokens = engine.metrics.value("shram_generation_tokens_total")
    _wait(lambda: _metric(url, **key) == before + 1, "the stream's row was not cancelled")
    assert engine.busy_rows == 0
    assert engine.metrics.value("shram_generation_tokens_total") - tokens < 100  # stopped long before 500
    # a non-streamed request whose client gives up is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=0.5)
    _wait(lambda: _metric(url, **key) == before + 2, "the request's row was not cancelled")
    text = httpx.get(f"{url}/metrics").text
    for name in ("busy_rows", "queue_depth", "generation_tokens_total", "step_seconds_sum"):
        assert f"shram_{name}" in text
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == BUILTIN_NAME


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def test_loading_auth_queue_chat_and_shutdown(model, solo, tmp_path):
    """503 while loading, 401 without the key, chat completions with a checkpoint's chat
    template, 429 + Retry-After when the queue is full, and a shutdown that ends a running
    stream cleanly."""
    release = threading.Event()
    TOK.save(tmp_path)  # the byte tokenizer as a checkpoint's tokenizer.json, plus a template
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    hf = HFTokenizer(tmp_path)
    attach_chat_template(hf, tmp_path)

    def load():
        assert release.wait(LIMIT_S)
        return StaticDecoder(model, batch_size=1, prefill_chunk=C), hf

    engine = Engine(load, max_queue=1)
    auth = {"Authorization": "Bearer sekrit"}
    long_req = {"prompt": "ROMEO:", "max_tokens": 900, "temperature": 0, "stream": True}
    srv = ServerThread(create_app(engine, api_key="sekrit"), shutdown_timeout=0.3)
    with srv as url:
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        assert set(health.json()["error"]) == {"message", "type", "param", "code"}
        status, err = _bad(url, P, headers=auth)
        assert status == 503 and "loading" in err["error"]["message"]
        release.set()
        assert engine.wait_ready(LIMIT_S) and httpx.get(f"{url}/health").status_code == 200
        assert _bad(url, P)[0] == 401
        assert _bad(url, P, headers={"Authorization": "Bearer wrong"})[0] == 401
        with pytest.raises(openai.AuthenticationError):
            client(url, key="wrong").completions.create(model=BUILTIN_NAME, prompt="x", max_tokens=2)
        c = client(url, key="sekrit")
        assert c.completions.create(model=BUILTIN_NAME, prompt="x", max_tokens=2).usage.completion_tokens == 2
        msgs = [{"role": "user", "content": "Who art thou?"}]
        want = solo(list(b"user: Who art thou?\nassistant:"), 12)
        r = c.chat.completions.create(model=BUILTIN_NAME, messages=msgs, max_tokens=12, temperature=0)
        assert (r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason) == want
        chunks = list(c.chat.completions.create(model=BUILTIN_NAME, messages=msgs, max_tokens=12,
                                                temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want[0]
        for fields in ({"max_completion_tokens": 5000}, {"max_tokens": 5000, "max_completion_tokens": 5000}):
            status, err = _bad(url, {"messages": msgs, **fields}, "/v1/chat/completions", headers=auth)
            assert (status, err["error"]["param"]) == (400, "max_completion_tokens")  # the field in effect
        with httpx.Client(headers=auth, timeout=LIMIT_S) as h:
            with h.stream("POST", f"{url}/v1/completions", json=long_req) as running:
                lines = running.iter_lines()
                next(lines)  # running in the only row
                with h.stream("POST", f"{url}/v1/completions", json=long_req) as queued:
                    assert queued.status_code == 200
                    _wait(lambda: engine.queue_depth == 1, "the second request did not queue")
                    full = h.post(f"{url}/v1/completions", json=P)
                    assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
                    assert full.json()["error"]["type"] == "rate_limit_error"
                # shutdown while `running` streams: it ends with a final chunk and [DONE]
                rest = concurrent.futures.ThreadPoolExecutor(1).submit(lambda: [x for x in lines if x])
                srv.__exit__()
                tail = rest.result(LIMIT_S)
    assert tail[-1] == "data: [DONE]"
    assert json.loads(tail[-2][6:])["choices"][0]["finish_reason"] == "cancelled"
    assert not srv.thread.is_alive() and engine.status == "stopped"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.heavy
def test_serve_command_starts_with_defaults_and_stops_on_sigterm():
    """`shram-static serve` (built-in model, eager) binds 127.0.0.1, serves, and on SIGTERM ends
    a running stream cleanly and exits with status 0."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "shram_static", "serve", "--backend", "eager",
                             "--port", str(port), "--shutdown-timeout", "0.5", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        def up():
            try:
                return httpx.get(f"{url}/health").status_code == 200
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read().decode()
                return False
        _wait(up, "the server did not become ready", every=0.25)
        body = {"prompt": "ROMEO:", "max_tokens": 900, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=LIMIT_S) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            tail = [x for x in lines if x]
        assert tail[-1] == "data: [DONE]"
        assert proc.wait(LIMIT_S) == 0  # a clean drain, not 143: a supervisor reads it as success
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(LIMIT_S)
