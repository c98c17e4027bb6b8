"""One request never takes the server down: faults injected into one row mid-run end that request
alone (the other streams' text is unchanged, /health stays 200); a step that fails for all rows
ends every request with an error and stops the server, which then exits non-zero. Every error
on every route is an OpenAI error object and is counted; /metrics parses with prometheus_client."""

import concurrent.futures
import json

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from shram_static import StaticDecoder  # noqa: E402
from shram_static.cli import main  # noqa: E402
from shram_static.default_model import default_model  # noqa: E402
from shram_static.serve.app import create_app  # noqa: E402
from shram_static.serve.engine import Engine  # noqa: E402
from shram_static.serve.server import ServerThread  # noqa: E402
from shram_static.tokenizer import ByteTokenizer, TokenIdsOnly, load_tokenizer  # noqa: E402

B, C = 4, 8
TOK = ByteTokenizer()
LIMIT_S = 60


class Faulty(StaticDecoder):
    """A decoder whose step gives NaN logits to a row once it holds `nan_at` tokens, and raises
    for all rows once `fail_in` more steps have run (None: never)."""

    nan_at: int | None = None
    fail_in: int | None = None

    def _run(self, tokens, input_pos, live, key=None):
        if self.fail_in is not None:
            self.fail_in -= 1
            if self.fail_in < 0:
                raise RuntimeError("injected: the step failed")
        out = super()._run(tokens, input_pos, live, key)
        if self.nan_at is not None:
            held = input_pos + live.long().sum(1)  # (B,) tokens each row holds after this step
            for b in torch.nonzero((held == self.nan_at) & live.any(1)).flatten().tolist():
                out[b] = float("nan")
        return out


class Flaky(ByteTokenizer):
    """The byte tokenizer, whose decode fails once when `armed` (for whichever request first
    decodes 6 generated tokens)."""

    armed = False

    def decode(self, ids):
        if self.armed and len(ids) == 6:
            Flaky.armed = False
            raise ValueError("injected: detokenizing failed")
        return super().decode(ids)


@pytest.fixture(scope="module")
def model():
    return default_model()


@pytest.fixture(scope="module")
def solo(model):
    dec = StaticDecoder(model, batch_size=1, prefill_chunk=C)

    def run(prompt: str, n: int) -> str:
        out = dec.generate(torch.tensor([TOK.encode(prompt)]), max_new_tokens=n,
                           eos_token_id=TOK.eos_token_id)[0].tolist()
        return TOK.decode(out[:out.index(TOK.eos_token_id)] if TOK.eos_token_id in out else out)
    return run


def _stream(url, prompt, n, **kw):
    """(text, error object or None, saw [DONE]) of one streamed completion (greedy unless `kw`
    says otherwise)."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, **kw}
    text, err, done = [], None, False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=LIMIT_S) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                obj = json.loads(line[6:])
                if "error" in obj:
                    err = obj["error"]
                else:
                    text.append(obj["choices"][0]["text"])
    return "".join(text), err, done


def _samples(url) -> dict:
    """{(name, labels without model): value} of /metrics, read by prometheus_client's parser."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=LIMIT_S).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model")))] = s.value
    return out


def _errors(url) -> float:
    return _samples(url)[("shram_requests_total", (("finish_reason", "error"),))]


OTHERS = [("ROMEO:", 24), ("Nay, ", 20), ("O", 22)]  # each holds at most 26 tokens
VICTIM = "KING HENRY:\nWhat say you, my lord of York?"  # 43 tokens with BOS


def test_a_fault_in_one_row_ends_that_request_alone(model, solo):
    """NaN logits in one request's row mid-stream, then a detokenizing failure in one of four
    streams: that request alone ends with an error (an error event on its stream, a 500 error
    object without streaming), its row is freed and counted; the others' text is unchanged."""
    dec = Faulty(model, batch_size=B, prefill_chunk=C)
    dec.nan_at = len(TOK.encode(VICTIM)) + 5  # after its 5th token; no other request gets there
    engine = Engine(lambda: (dec, Flaky()), max_queue=16)
    with ServerThread(create_app(engine), shutdown_timeout=1) as url:
        assert engine.wait_ready(LIMIT_S)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            others = [pool.submit(_stream, url, p, n) for p, n in OTHERS]
            victim = _stream(url, VICTIM, 40)
            got = [f.result(LIMIT_S) for f in others]
        assert victim[1]["type"] == "server_error" and "NaN" in victim[1]["message"] and victim[2]
        assert len(victim[0]) == 5  # its 5 tokens (bytes) came before the error
        for (p, n), (text, err, done) in zip(OTHERS, got):
            assert (text, err, done) == (solo(p, n), None, True), p
        r = httpx.post(f"{url}/v1/completions", json={"prompt": VICTIM, "max_tokens": 9, "temperature": 0},
                       timeout=LIMIT_S)
        assert r.status_code == 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert httpx.get(f"{url}/health").status_code == 200 and engine.busy_rows == 0
        assert _errors(url) == 2
        dec.nan_at = None

        Flaky.armed = True  # one of four streams fails while detokenizing
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda pn: _stream(url, *pn), OTHERS + [("HAMLET:", 21)]))
        failed = [g for g in got if g[1] is not None]
        assert len(failed) == 1 and "detokenizing" in failed[0][1]["message"]
        for (p, n), g in zip(OTHERS + [("HAMLET:", 21)], got):
            if g[1] is None:
                assert g[0] == solo(p, n), p
        assert _errors(url) == 3 and engine.busy_rows == 0
        assert _stream(url, "ROMEO:", 24)[0] == solo("ROMEO:", 24)  # serving as before
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_failed_step_ends_every_request_and_stops_the_server(model):
    """A step that raises (the shared state is unusable): every running and queued request ends
    with an error, and the server shuts down by itself with `failed` set."""
    dec = Faulty(model, batch_size=2, prefill_chunk=C)
    engine = Engine(lambda: (dec, TOK), max_queue=16)
    srv = ServerThread(create_app(engine), shutdown_timeout=1)
    with srv as url:
        assert engine.wait_ready(LIMIT_S)
        dec.fail_in = 12  # a few tokens into the streams
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: _stream(url, p, 200), ["ROMEO:", "Nay, ", "O", "HAMLET:"]))
        for text, err, done in got:
            assert err["type"] == "server_error" and "injected" in err["message"] and done
        srv.thread.join(LIMIT_S)  # the server stopped by itself
        assert not srv.thread.is_alive()
    assert engine.status == "failed" and "injected" in srv.server.failed


def test_serve_exits_nonzero_when_the_model_cannot_load(tmp_path, capsys):
    """A server never sits at 503 for ever: `serve` of a checkpoint that fails to load exits 1
    (its weights file is not safetensors); a directory that is missing is refused at once, before
    any server starts, as every command refuses it (status 2)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "shram"}))
    (bad / "model.safetensors").write_bytes(b"not safetensors")
    args = ["--backend", "eager", "--port", "0", "--log-level", "critical"]
    assert main(["serve", "--checkpoint", str(bad), *args]) == 1
    assert "could not be loaded" in capsys.readouterr().err
    assert main(["serve", "--checkpoint", str(tmp_path / "missing"), *args]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "could not be loaded" not in err


@pytest.fixture(scope="module")
def server(model):
    engine = Engine(lambda: (StaticDecoder(model, batch_size=2, prefill_chunk=C), TOK), max_queue=8)
    name = 'we"ird\\name\nx'
    with ServerThread(create_app(engine, model_name=name, max_body_bytes=4096), shutdown_timeout=1) as url:
        assert engine.wait_ready(LIMIT_S)
        yield url, name


def _send(url, method, path, content=b"", headers=None):
    r = httpx.request(method, f"{url}{path}", content=content, timeout=LIMIT_S,
                      headers={"content-type": "application/json", **(headers or {})})
    return r.status_code, r.json()


def test_every_error_is_an_openai_error_object_and_counted(server, solo):
    url, name = server
    ok = {"prompt": "ROMEO:", "max_tokens": 4, "model": name}
    cases = [  # (method, path, body, headers, status, param)
        ("GET", "/v1/nowhere", b"", None, 404, None),
        ("POST", "/nowhere", b"{}", None, 404, None),
        ("GET", "/v1/completions", b"", None, 405, None),
        ("DELETE", "/health", b"", None, 405, None),
        ("POST", "/v1/completions", b"x" * 5000, None, 413, None),
        ("POST", "/v1/completions", json.dumps(ok).encode(), {"content-type": "text/plain"}, 415, None),
        ("POST", "/v1/completions", b'{"prompt": "caf\xe9"}', None, 400, None),  # not UTF-8
        ("POST", "/v1/completions", b"[" * 2000 + b"]" * 2000, None, 400, None),  # nested deep
        ("POST", "/v1/completions", json.dumps({**ok, "prompt": "ab\ud800"}).encode(), None, 400, "prompt"),
        ("POST", "/v1/completions", json.dumps({**ok, "stop": ["\udfff"]}).encode(), None, 400, "stop"),
        ("POST", "/v1/completions", json.dumps({**ok, "stop": list("abcde")}).encode(), None, 400, "stop"),
        ("POST", "/v1/completions", json.dumps({**ok, "stop": "s" * 65}).encode(), None, 400, "stop"),
        ("POST", "/v1/chat/completions",
         json.dumps({"messages": [{"role": "user", "content": "\ud800"}]}).encode(), None, 400, "messages"),
    ]
    before = _samples(url)
    for method, path, body, headers, status, param in cases:
        got, err = _send(url, method, path, body, headers)
        assert got == status, (method, path, err)
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
        assert err["error"]["message"] and err["error"]["param"] == param, err
    after = _samples(url)
    for status in (400, 404, 405, 413, 415):
        key = ("shram_http_errors_total", (("status", str(status)),))
        want = sum(c[4] == status for c in cases)
        assert after[key] - before.get(key, 0) == want, status
    assert after[("shram_requests_invalid_total", ())] - before[("shram_requests_invalid_total", ())] == 7
    # a stop string as long as the limit is fine, and the server still serves as before
    r = httpx.post(f"{url}/v1/completions", json={**ok, "max_tokens": 12, "temperature": 0, "stop": ["z" * 64]},
                   timeout=LIMIT_S)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == solo("ROMEO:", 12)


def test_metrics_parse_with_an_awkward_model_name(server):
    """prometheus_client's parser reads /metrics: a model name with quotes, a backslash and a
    newline round-trips as the `model` label, and the latency histograms are there."""
    url, name = server
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "O", "max_tokens": 5, "temperature": 0},
                      timeout=LIMIT_S).status_code == 200
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    for h in ("time_to_first_token", "inter_token_latency", "request_latency", "queue_wait"):
        fam = fams[f"shram_{h}_seconds"]
        assert fam.type == "histogram" and {s.labels["model"] for s in fam.samples} == {name}
        count = [s.value for s in fam.samples if s.name.endswith("_count")][0]
        assert count >= (4 if h == "inter_token_latency" else 1), h
    assert {s.labels["model"] for f in fams.values() for s in f.samples} == {name}
    tokens = [s.value for s in fams["shram_generation_tokens"].samples if s.name.endswith("_total")][0]
    assert tokens >= 5


def test_tokenizer_must_cover_the_model(tmp_path):
    """The byte tokenizer is refused for a model it cannot cover, naming both sizes and how to
    supply a tokenizer.json; `TokenIdsOnly` serves such a model by token ids."""
    class Cfg:
        vocab_size = 50277
    with pytest.raises(ValueError, match=r"50277.*259.*tokenizer\.json.*--token-ids-only"):
        load_tokenizer(tmp_path, Cfg())
    Cfg.vocab_size = 263  # a vocabulary padded past the bytes and specials: covered
    assert load_tokenizer(tmp_path, Cfg()).decode([72, 105, 260]) == "Hi"
    TOK.save(tmp_path)
    assert load_tokenizer(tmp_path, Cfg()).encode("Hi") == TOK.encode("Hi")


def test_token_ids_only_serving(model):
    """--token-ids-only: token-id prompts are served (choices carry token_ids: greedy's), text
    prompts and stop strings get 400."""
    V = model.config.vocab_size
    engine = Engine(lambda: (StaticDecoder(model, batch_size=1, prefill_chunk=C), TokenIdsOnly(V)), max_queue=4)
    ids = TOK.encode("ROMEO:")
    want = StaticDecoder(model, batch_size=1, prefill_chunk=C).generate(torch.tensor([ids]), max_new_tokens=6)
    with ServerThread(create_app(engine), shutdown_timeout=1) as url:
        assert engine.wait_ready(LIMIT_S)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0},
                       timeout=LIMIT_S).json()
        assert r["choices"][0]["token_ids"] == want[0].tolist() and r["choices"][0]["text"] == ""
        for body, param in (({"prompt": "ROMEO:"}, "prompt"), ({"prompt": ids, "stop": "x"}, "stop")):
            st, err = _send(url, "POST", "/v1/completions", json.dumps(body).encode())
            assert st == 400 and err["error"]["param"] == param and "token" in err["error"]["message"]


def test_tiny_temperatures_serve_greedy_text(server, solo):
    """Any temperature the schema accepts works: a tiny one gives greedy's text, streamed or not
    (dividing float32 logits by 1e-300 overflowed, and the NaN stopped the engine)."""
    url, _ = server
    want = solo("ROMEO:", 10)
    for T in (5e-324, 1e-300, 1e-38, 1e-6):
        body = {"prompt": "ROMEO:", "max_tokens": 10, "temperature": T, "top_p": 0.5}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=LIMIT_S)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, T
        assert _stream(url, "ROMEO:", 10, temperature=T)[:2] == (want, None)
    assert httpx.get(f"{url}/health").status_code == 200
