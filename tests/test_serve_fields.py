"""OpenAI's logit fields on a live server, through the real `openai` client: `logit_bias`,
`presence_penalty`, `frequency_penalty`, vLLM's `repetition_penalty`, and the `logprobs` of
completions and chat, streamed or not.

Each served result is checked against an independent computation: the eager model's forward
over the whole sequence at each step (no static state, no server, no `Sampler`), the formulas
applied by hand in numpy (`test_sampling.adjusted`), greedy's argmax, and the raw logprobs
(log-softmax of the model's logits, before the adjustments: vLLM's default)."""

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from test_sampling import adjusted  # noqa: E402
from shram_static import StaticDecoder  # noqa: E402
from shram_static.default_model import default_model  # noqa: E402
from shram_static.serve.app import BUILTIN_NAME, attach_chat_template, create_app  # noqa: E402
from shram_static.serve.engine import Engine  # noqa: E402
from shram_static.serve.server import ServerThread  # noqa: E402
from shram_static.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402

TOK = ByteTokenizer()
EOS, BOS = TOK.eos_token_id, TOK.bos_token_id
LIMIT_S = 60
N = 12  # new tokens per request
TOP = 3  # top logprobs asked for
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def model():
    return default_model()


@pytest.fixture(scope="module")
def client(model, tmp_path_factory):
    """An `openai` client of an eager 2-row server of the built-in model whose tokenizer (the
    byte tokenizer's tokenizer.json) has a chat template."""
    d = tmp_path_factory.mktemp("tok")
    TOK.save(d)
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    hf = HFTokenizer(d)
    attach_chat_template(hf, d)
    engine = Engine(lambda: (StaticDecoder(model, batch_size=2, prefill_chunk=8), hf), max_queue=8)
    with ServerThread(create_app(engine), shutdown_timeout=1) as url:
        assert engine.wait_ready(LIMIT_S)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=LIMIT_S)


def reference(model, prompt: list[int], adjust: dict):
    """Oracle: greedy decoding with the adjustments, on the eager model's logits of the whole
    sequence at each step. Returns (tokens up to EOS, per token (its raw logprob, the TOP
    largest raw logprobs))."""
    bias = {int(k): v for k, v in adjust.get("logit_bias", {}).items()}
    out, lps = [], []
    while len(out) < N and EOS not in out:
        with torch.no_grad():
            x = model(torch.tensor([prompt + out])).logits[0, -1].double().numpy()
        z = adjusted(x, prompt, out, bias, adjust.get("presence_penalty", 0.0),
                     adjust.get("frequency_penalty", 0.0), adjust.get("repetition_penalty", 1.0))
        tok = int(z.argmax())
        logp = x - x.max() - np.log(np.exp(x - x.max()).sum())
        out.append(tok)
        lps.append((logp[tok], np.sort(logp)[::-1][:TOP]))
    return out, lps


def text(tokens: list[int]) -> str:
    return TOK.decode([t for t in tokens if t != EOS])


CASES = [  # (endpoint, stream, completion prompt, adjustments): each changes the greedy text
    ("completions", False, b"O Romeo, Romeo", {"frequency_penalty": 1.2, "presence_penalty": 0.4}),
    ("completions", True, b"ROMEO:", {"repetition_penalty": 1.5, "logit_bias": {str(ord("e")): 4.0}}),
    ("chat", False, None, {"logit_bias": {str(ord(" ")): -100}, "presence_penalty": -0.5}),
    ("chat", True, None, {"frequency_penalty": 2.0, "repetition_penalty": 1.2}),
]


@pytest.mark.parametrize("endpoint, stream, start, adjust", CASES)
def test_adjusted_greedy_and_logprobs_match_an_independent_computation(model, client, endpoint, stream, start,
                                                                       adjust):
    if endpoint == "completions":
        prompt = [BOS] + list(start)
        kw = dict(prompt=prompt, logprobs=TOP)
        call = client.completions.create
    else:
        prompt = list(b"user: Who art thou?\nassistant:")  # the template's text, no BOS
        kw = dict(messages=[{"role": "user", "content": "Who art thou?"}], logprobs=True, top_logprobs=TOP)
        call = client.chat.completions.create
    want, want_lps = reference(model, prompt, adjust)
    assert text(want) != text(reference(model, prompt, {})[0]), "the adjustment changes nothing here"
    known = {k: v for k, v in adjust.items() if k != "repetition_penalty"}  # the client's own arguments
    extra = {k: v for k, v in adjust.items() if k == "repetition_penalty"}  # vLLM's, as its clients send it
    r = call(model=BUILTIN_NAME, max_tokens=N, temperature=0, stream=stream, extra_body=extra, **kw, **known)
    chunks = list(r) if stream else [r]
    got_text, lps = "", []  # lps: per token (its logprob, its top logprobs)
    for ch in chunks:
        c = ch.choices[0]
        if endpoint == "completions":
            got_text += c.text
            if c.logprobs is not None:
                lps += [(lp, sorted(top.values(), reverse=True)) for lp, top in
                        zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs)]
                # as OpenAI: the sampled token is among the top ones (logprobs + 1 at most)
                assert all(t in top and len(top) <= TOP + 1 for t, top in zip(c.logprobs.tokens,
                                                                           c.logprobs.top_logprobs))
        else:
            got_text += (c.delta.content or "") if stream else c.message.content
            if c.logprobs is not None:
                lps += [(e.logprob, [t.logprob for t in e.top_logprobs]) for e in c.logprobs.content]
                assert all(bytes(e.bytes).decode() == e.token for e in c.logprobs.content)
    assert got_text == text(want)
    assert len(lps) == len(want)
    for (lp, top), (want_lp, want_top) in zip(lps, want_lps):
        assert abs(lp - want_lp) < 1e-3, (lp, want_lp)  # raw: before the adjustments
        if endpoint == "chat":
            np.testing.assert_allclose(top, want_top, atol=1e-3)
        else:  # completions' dict keys are texts: tokens of equal text (U+FFFD) keep the largest
            assert abs(top[0] - want_top[0]) < 1e-3


def test_sampled_with_adjustments_is_generates(model, client):
    """A seeded sampled request with the adjustments gets `HostDecoder.generate`'s tokens for
    the same settings and seed (one sampler, one rule)."""
    adjust = {"logit_bias": {str(ord("a")): 3.0}, "presence_penalty": 0.8, "frequency_penalty": 0.3,
              "repetition_penalty": 1.3}
    prompt = [BOS] + list(b"JULIET:")
    dec = StaticDecoder(model, batch_size=1, prefill_chunk=8)

    def generate(**kw):
        out = dec.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=True, temperature=0.9, seed=11,
                           eos_token_id=EOS, **kw)[0].tolist()
        return text(out[:out.index(EOS) + 1] if EOS in out else out)

    want = generate(**{**adjust, "logit_bias": {int(k): v for k, v in adjust["logit_bias"].items()}})
    assert want != generate()  # the adjustments change this sample
    r = client.completions.create(model=BUILTIN_NAME, prompt=prompt, max_tokens=20, temperature=0.9, seed=11,
                                  extra_body={"repetition_penalty": 1.3},
                                  **{k: v for k, v in adjust.items() if k != "repetition_penalty"})
    assert r.choices[0].text == want
