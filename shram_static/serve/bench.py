"""`shram-static bench-serve`: the same requests one at a time to a batch-1 server, then from N
concurrent streaming clients to a batch-B server, each in this process (docs/performance.md, "Serving")."""

import asyncio
import contextlib
import json
import random
import re
import subprocess
import sys
import time

from ..backends import find_backend
from ..console import info


class _IdText:
    """Each id is the text ' <id>', no EOS: every request runs to its max_tokens, a chunk a token."""

    eos_token_id = bos_token_id = None

    def decode(self, ids) -> str:
        return "".join(f" {int(i)}" for i in ids)


def _span(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)-(\d+)", text)
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise ValueError(f"expected a range LO-HI of positive integers, got {text!r}")
    return int(m[1]), int(m[2])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def _wait_ready(client, url: str, limit_s: float = 1800) -> None:
    t0 = time.monotonic()
    while True:
        r = await client.get(f"{url}/health")
        if r.status_code == 200:
            return
        body = r.json()
        if body.get("status") == "failed" or time.monotonic() - t0 > limit_s:
            raise RuntimeError(f"the server did not become ready: {body}")
        await asyncio.sleep(0.2)


async def _one(client, url: str, prompt: list[int], n: int) -> dict:
    """One streaming request: its start, each chunk's arrival time, the tokens."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    times, text = [], []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request failed: {r.status_code} {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            t = chunk["choices"][0]["text"] if chunk.get("choices") else ""
            if t:
                times.append(time.perf_counter())
                text.append(t)
    return {"start": t0, "times": times, "tokens": len("".join(text).split())}


async def _metrics(client, url: str) -> dict:
    """{sample: value} of /metrics, without the model label ('shram_step_seconds_sum{shape="decode"}')."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families((await client.get(f"{url}/metrics")).text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


async def _run(url: str, reqs: list[tuple[list[int], int]], concurrent: bool) -> dict:
    import httpx
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=len(reqs) + 4)) as c:
        await _wait_ready(c, url)
        await _one(c, url, reqs[0][0], 4)  # first-call costs out of the way
        m0 = await _metrics(c, url)
        t0 = time.perf_counter()
        if concurrent:
            res = await asyncio.gather(*(_one(c, url, p, n) for p, n in reqs))
        else:
            res = [await _one(c, url, p, n) for p, n in reqs]
        wall = time.perf_counter() - t0
        m1 = await _metrics(c, url)
    d = {k: m1[k] - m0.get(k, 0) for k in m1}
    toks = sum(r["tokens"] for r in res)
    step = lambda k: (d[f'shram_step_seconds_sum{{shape="{k}"}}']
                      / max(1, d[f'shram_step_seconds_count{{shape="{k}"}}']))
    itl = [b - a for r in res for a, b in zip(r["times"], r["times"][1:])]
    ttft = [r["times"][0] - r["start"] for r in res]
    return {"tokens": toks, "wall_s": wall, "tokens_per_s": toks / wall,
            "ttft_ms_p50": 1e3 * _pct(ttft, 0.5), "ttft_ms_p99": 1e3 * _pct(ttft, 0.99),
            "itl_ms_p50": 1e3 * _pct(itl, 0.5), "itl_ms_p99": 1e3 * _pct(itl, 0.99),
            "occupancy": d["shram_busy_row_steps_total"] / max(1, d["shram_row_steps_total"]),
            "decode_step_ms": 1e3 * step("decode"), "prefill_step_ms": 1e3 * step("prefill")}


def _serve_once(model, args, batch_size: int, reqs, concurrent: bool) -> dict:
    import torch

    from ..decoders import make_decoder
    from .app import create_app
    from .server import ServerThread
    from .engine import Engine

    with contextlib.ExitStack() as stack:
        load = lambda: (make_decoder(model, args.backend, args.prefill_chunk, stack, None, None,
                                     batch_size=batch_size), _IdText())
        info(f"server: {args.backend}, batch {batch_size}; loading"
             + (" and compiling" if find_backend(args.backend).runtime == "compiled" else "") + " ...")
        app = create_app(Engine(load, max_queue=len(reqs) + 1), model_name="bench")
        with torch.no_grad(), ServerThread(app) as url:
            # the clients run in a process of their own: here they would take the GIL from the steps
            job = json.dumps({"url": url, "requests": reqs, "concurrent": concurrent})
            out = subprocess.run([sys.executable, "-m", "shram_static.serve.bench"], input=job,
                                 capture_output=True, text=True, timeout=3600)
            if out.returncode:
                raise RuntimeError(f"the benchmark's client process failed:\n{out.stderr[-2000:]}")
            return json.loads(out.stdout.strip().splitlines()[-1])


def bench_serve(args) -> int:
    """The `bench-serve` subcommand."""
    from ..bench import build_model

    (lo_p, hi_p), (lo_n, hi_n) = _span(args.prompt_tokens), _span(args.output_tokens)
    model = build_model(args.model if args.checkpoint is None else args.checkpoint)  # sends token ids only
    S, V = model.config.inference_sequence_length, model.config.vocab_size
    if hi_p + hi_n - 1 > S:
        raise ValueError(f"prompts up to {hi_p} plus outputs up to {hi_n} tokens exceed the capacity {S}")
    rng = random.Random(args.seed)
    reqs = [([rng.randrange(V) for _ in range(rng.randint(lo_p, hi_p))], rng.randint(lo_n, hi_n))
            for _ in range(args.clients)]
    solo = _serve_once(model, args, 1, reqs, concurrent=False)
    conc = _serve_once(model, args, args.batch_size, reqs, concurrent=True)
    target_itl = 2 * solo["decode_step_ms"] + solo["prefill_step_ms"]
    res = {"backend": args.backend, "batch_size": args.batch_size, "clients": args.clients,
           "prefill_chunk": args.prefill_chunk, "prompt_tokens": args.prompt_tokens,
           "output_tokens": args.output_tokens, "one_at_a_time": solo, "concurrent": conc,
           "speedup": conc["tokens_per_s"] / solo["tokens_per_s"], "itl_target_ms": target_itl}
    f = lambda x: f"{x:.1f}"
    print(f"one at a time (batch 1): {f(solo['tokens_per_s'])} tok/s, decode step "
          f"{f(solo['decode_step_ms'])} ms, prefill step {f(solo['prefill_step_ms'])} ms")
    print(f"{args.clients} concurrent (batch {args.batch_size}): {f(conc['tokens_per_s'])} tok/s = "
          f"{res['speedup']:.2f}x (target >= 2.0x); occupancy {conc['occupancy']:.2f}")
    print(f"  TTFT p50 {f(conc['ttft_ms_p50'])} ms, p99 {f(conc['ttft_ms_p99'])} ms; inter-token p50 "
          f"{f(conc['itl_ms_p50'])} ms, p99 {f(conc['itl_ms_p99'])} ms (target <= {f(target_itl)} ms = 2 x "
          f"decode step + prefill step at batch 1)")
    print(f"  steps at batch {args.batch_size}: decode {f(conc['decode_step_ms'])} ms, prefill "
          f"{f(conc['prefill_step_ms'])} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":  # the client process of `_serve_once`: a job on stdin, results on stdout
    _job = json.loads(sys.stdin.read())
    print(json.dumps(asyncio.run(_run(_job["url"], _job["requests"], _job["concurrent"]))))
