"""The OpenAI-compatible HTTP API (FastAPI): a plain ASGI app over one `Engine`, one model per
process. Every response that is not a success is an OpenAI error object (docs/serving.md)."""

import asyncio
import contextlib
import json
import os
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from .engine import Engine, Event, Job, NotReady, QueueFull
from .guard import BearerAuth, Guard
from .limits import MAX_BODY_BYTES, MAX_STOP, MAX_STOP_CHARS
from .logprobs import chat_logprobs, completion_logprobs
from .schema import APIError, ChatCompletionRequest, CompletionRequest, validation_error

BUILTIN_NAME = "shram-static-builtin"


def load_decoder(checkpoint: str | None, backend: str, batch_size: int, prefill_chunk: int,
                 stack: contextlib.ExitStack, token_ids_only: bool = False):
    """(decoder, tokenizer) of a checkpoint (None: the built-in model); `stack` owns an export's files."""
    from ..decoders import make_decoder
    from ..default_model import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(checkpoint, token_ids_only=token_ids_only)
    if checkpoint is not None:
        attach_chat_template(tok, checkpoint)
    dec = make_decoder(model, backend, prefill_chunk, stack, tok.eos_token_id,
                       getattr(tok, "bos_token_id", None), batch_size=batch_size)
    return dec, tok


def attach_chat_template(tok, directory) -> None:
    """Gives a checkpoint's HF tokenizer without one its directory's chat template (as `AutoTokenizer`)."""
    hf = getattr(tok, "tok", None)
    if hf is None or getattr(hf, "chat_template", None):
        return
    path = os.path.join(os.fspath(directory), "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            hf.chat_template = f.read()
        return
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(os.fspath(directory), "tokenizer_config.json"), encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
        if isinstance(template, str):
            hf.chat_template = template


def create_app(engine: Engine | None = None, *, checkpoint: str | None = None, backend: str = "eager",
               batch_size: int = 4, prefill_chunk: int = 16, max_queue: int = 64,
               api_key: str | None = None, model_name: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, max_stop: int = MAX_STOP,
               max_stop_chars: int = MAX_STOP_CHARS, token_ids_only: bool = False) -> FastAPI:
    """The server app.

    Args:
        engine: an `Engine` to serve (started by the app if not yet); default: one loading `checkpoint`.
        checkpoint: checkpoint directory; None: the built-in model.
        backend: one of `backends.BACKENDS`.
        batch_size: B, requests served at once (one per row).
        prefill_chunk: C, prompt tokens per prefill-shape step.
        max_queue: requests that may wait for a row; more get 429.
        api_key: when set, /v1/* requests need `Authorization: Bearer <api_key>`.
        model_name: the id of `/v1/models` (default: the checkpoint directory's name, or BUILTIN_NAME).
        max_body_bytes: the largest request body; a larger one gets 413.
        max_stop, max_stop_chars: most stop strings per request, and the longest; more gets 400.
        token_ids_only: serve without a tokenizer: prompts and choices as token ids, text gets 400.

    Returns:
        A FastAPI (ASGI) application.
    """
    stack = contextlib.ExitStack()
    if engine is None:
        engine = Engine(lambda: load_decoder(checkpoint, backend, batch_size, prefill_chunk, stack,
                                             token_ids_only), max_queue=max_queue)
    name = model_name or (BUILTIN_NAME if checkpoint is None
                          else os.path.basename(os.path.normpath(os.fspath(checkpoint))))
    engine.metrics.set_model(name)
    created = int(time.time())
    stops = (max_stop, max_stop_chars)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not engine.started:
            engine.start()
        yield
        await asyncio.to_thread(engine.stop)
        stack.close()

    app = FastAPI(title="shram-static", lifespan=lifespan)
    app.state.engine = engine
    app.state.model_name = name
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(Guard, metrics=engine.metrics, max_body_bytes=max_body_bytes)  # outermost

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return validation_error(list(e.errors())).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        # FastAPI's own: an unknown path (404), a wrong method (405), an unparsable body (400)
        if e.status_code == 404:
            msg = f"unknown URL: {request.method} {request.url.path}"
        elif e.status_code == 405:
            msg = (f"method {request.method} is not allowed on {request.url.path}"
                   + (f" (allowed: {e.headers['allow']})" if e.headers and "allow" in e.headers else ""))
        elif e.status_code == 400:
            msg = "the request body could not be read as JSON (it must be UTF-8, nested at most ~1000 levels deep)"
        else:
            msg = str(e.detail)
        return APIError(e.status_code, msg, headers=dict(e.headers or {})).response()

    @app.get("/health")
    async def health():
        """200 when the model is ready; 503 (an OpenAI error object, plus the status) while it
        loads or compiles, or once it failed (the server then exits)."""
        if engine.ready:
            return {"status": engine.status}
        e = APIError(503, engine.error or f"the model is {engine.status}", type_="service_unavailable",
                     headers={"Retry-After": "1"})
        return JSONResponse({**e.body(), "status": engine.status}, status_code=503, headers=e.headers)

    @app.get("/metrics")
    async def metrics():
        """Prometheus text: requests, tokens, errors, queue depth, busy rows, step time, and
        histograms of time to first token, inter-token latency, request latency, queue wait."""
        B = engine.decoder.batch_size if engine.ready else 0
        return Response(engine.metrics.render(engine.queue_depth, engine.busy_rows, B),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {"id": name, "object": "model", "created": created, "owned_by": "shram-static"}
        if engine.ready:
            card["max_model_len"] = engine.capacity
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, name)
        _need_ready(engine)
        ids, text = _prompt(body.prompt, engine)
        if body.logprobs is not None and body.echo:
            raise APIError(400, "'echo' with 'logprobs' is not supported: the prompt's tokens get no "
                                "logprobs here (send one or the other)", "echo")
        # unset: 16 tokens, as OpenAI's legacy completions and vLLM (at most what fits)
        n = body.max_tokens if body.max_tokens is not None else min(16, engine.capacity - len(ids) + 1)
        job = _job(body, ids, n, engine, stops, body.logprobs)
        return await _Run(engine, job, request, "text_completion", name,
                          echo=text if body.echo else "").respond(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model, name)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        _need_ready(engine)
        tok = engine.tokenizer
        template = getattr(getattr(tok, "tok", None), "chat_template", None)
        if not template:
            raise APIError(400, f"model {name!r} has no chat template (its tokenizer defines none); "
                                f"use /v1/completions with a text prompt", "messages")
        msgs = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = tok.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja errors: a message the template cannot render
            raise APIError(400, f"the chat template could not render 'messages': {e}", "messages") from e
        ids = _check_ids(_encode(tok, text, "messages", add_bos=False), engine, "messages")
        field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"  # which one counts
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        job = _job(body, ids, getattr(body, field), engine, stops, logprobs, field)
        return await _Run(engine, job, request, "chat.completion", name).respond(body)

    return app


def _check_model(model: str | None, name: str) -> None:
    if model is not None and model != name:
        raise APIError(400, f"unknown model {model!r}: this server serves {name!r}", "model",
                       code="model_not_found")


def _need_ready(engine: Engine) -> None:
    if not engine.ready:
        raise APIError(503, f"the model is not ready ({engine.status}); retry shortly",
                       type_="service_unavailable", headers={"Retry-After": "1"})


def _prompt(prompt, engine: Engine) -> tuple[list[int], str]:
    """(token ids, text) of a completions prompt (one prompt per request)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"'prompt' holds {len(prompt)} prompts; send one per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _check_ids(_encode(engine.tokenizer, prompt, "prompt"), engine, "prompt"), prompt
    ids = _check_ids(prompt, engine, "prompt")
    return ids, engine.tokenizer.decode(ids)


def _ids_only(tokenizer) -> bool:
    return getattr(tokenizer, "token_ids_only", False)


def _encode(tokenizer, text: str, param: str, add_bos: bool = True) -> list[int]:
    """The token ids of a text, or a 400 naming `param`."""
    if _ids_only(tokenizer):
        raise APIError(400, f"this server has no tokenizer (--token-ids-only): send '{param}' as a list "
                            f"of token ids", param)
    try:
        return tokenizer.encode(text, add_bos=add_bos)
    except UnicodeError as e:  # a lone surrogate ("\\ud800") is not text
        raise APIError(400, f"'{param}' is not valid Unicode text: {e}", param) from e


def _check_ids(ids: list[int], engine: Engine, param: str) -> list[int]:
    V, S = engine.decoder.config.vocab_size, engine.capacity
    if not ids:
        raise APIError(400, f"'{param}' is empty: it needs at least one token", param)
    if bad := [i for i in ids if not 0 <= i < V]:
        raise APIError(400, f"'{param}' holds token ids outside the vocabulary [0, {V}): {bad[:8]}", param)
    if len(ids) > S:
        raise APIError(400, f"'{param}' is {len(ids)} tokens, more than the model's context capacity "
                            f"of {S} tokens", param)
    return list(ids)


def _job(body, ids: list[int], max_tokens: int | None, engine: Engine, limits: tuple[int, int],
         logprobs: int | None, field: str = "max_tokens") -> Job:
    S, V = engine.capacity, engine.decoder.config.vocab_size
    stop, (most, longest) = body.stops(), limits
    if len(stop) > most:
        raise APIError(400, f"'stop' holds {len(stop)} strings; at most {most} are allowed", "stop")
    if any(len(s) > longest for s in stop):
        raise APIError(400, f"a 'stop' string is longer than {longest} characters", "stop")
    if stop and _ids_only(engine.tokenizer):
        raise APIError(400, "this server has no tokenizer (--token-ids-only): 'stop' strings cannot be "
                            "matched", "stop")
    if max_tokens is not None and len(ids) + max_tokens - 1 > S:
        raise APIError(400, f"'{field}' is too large: the prompt ({len(ids)} tokens) plus {max_tokens} "
                            f"new tokens exceed the context capacity of {S} tokens (at most "
                            f"{S - len(ids) + 1} new tokens for this prompt)", field)
    bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    if any(k >= V for k in bias):
        raise APIError(400, f"'logit_bias' holds token ids outside the vocabulary [0, {V}): "
                            f"{sorted(k for k in bias if k >= V)[:8]}", "logit_bias")
    return Job(prompt=ids, sink=None, max_tokens=max_tokens,
               temperature=1.0 if body.temperature is None else body.temperature,
               top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=stop, logprobs=logprobs,
               logit_bias=bias or None, presence_penalty=body.presence_penalty or 0.0,
               frequency_penalty=body.frequency_penalty or 0.0,
               repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty)


class _Run:
    """Submits one job and turns its events into an OpenAI response or an SSE stream."""

    def __init__(self, engine: Engine, job: Job, request: Request, kind: str, model: str, echo: str = ""):
        self.job, self.request, self.kind, self.model = job, request, kind, model
        self.echo, self.tok = echo, engine.tokenizer
        self.offset = len(echo)  # the text offset of the next token's logprobs (completions)
        self.ids_only = _ids_only(self.tok)
        self.id = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        loop = asyncio.get_running_loop()
        self.q: asyncio.Queue[Event] = asyncio.Queue()
        job.sink = lambda ev: loop.call_soon_threadsafe(self.q.put_nowait, ev)
        try:
            engine.submit(job)
        except QueueFull as e:
            raise APIError(429, f"{e}; retry shortly", type_="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from e
        except NotReady as e:
            raise APIError(503, str(e), type_="service_unavailable", headers={"Retry-After": "1"}) from e

    async def respond(self, body):
        """An SSE stream when `body` asks for one, else the whole response."""
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self.stream(usage), media_type="text/event-stream")
        return await self.complete()

    def _usage(self) -> dict:
        P, n = len(self.job.prompt), len(self.job.tokens)
        return {"prompt_tokens": P, "completion_tokens": n, "total_tokens": P + n}

    def _choice(self, text: str, finish: str | None, delta: bool, first: bool = False,
                logprobs=None, tokens: list[int] | None = None) -> dict:
        if self.kind == "text_completion":
            c = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if self.ids_only:  # no tokenizer: the tokens themselves (as vLLM's token_ids)
                c["token_ids"] = tokens or []
            return c
        if not delta:
            return {"index": 0, "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs, "finish_reason": finish}
        d = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish}

    def _obj(self, choices: list, chunk: bool, usage) -> dict:
        kind = self.kind + (".chunk" if chunk and self.kind.startswith("chat") else "")
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
               "choices": choices}
        if usage is not False:
            out["usage"] = usage
        return out

    def _logprobs(self, tokens: list[int], lps: list | None):
        """The `logprobs` object of these tokens (None when not asked for); offsets carry on."""
        if self.job.logprobs is None:
            return None
        if self.kind.startswith("chat"):
            return chat_logprobs(self.tok, tokens, lps or [])
        out, self.offset = completion_logprobs(self.tok, tokens, lps or [], self.offset)
        return out

    async def complete(self) -> dict:
        """Waits for the whole result (the row is cancelled if the client goes away)."""
        parts, lps, finish = [], [], None
        gone = asyncio.ensure_future(_disconnected(self.request))
        try:
            while finish is None:
                get = asyncio.ensure_future(self.q.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    self.job.cancel()
                    return APIError(499, "the client closed the connection").response()  # nobody reads it
                ev = get.result()
                parts.append(ev.text)
                lps += ev.logprobs or []
                finish = ev.finish_reason
        finally:
            gone.cancel()
            if finish is None:
                self.job.cancel()
        if finish == "error":
            raise APIError(500, f"the model failed: {ev.error}", type_="server_error")
        text = self.echo + "".join(parts)
        logprobs = self._logprobs(self.job.tokens[:len(lps)], lps)
        choice = self._choice(text, finish, False, logprobs=logprobs, tokens=list(self.job.tokens))
        return self._obj([choice], False, self._usage())

    async def stream(self, include_usage: bool):
        """OpenAI server-sent events: chunks, the usage chunk when asked, then [DONE]."""
        usage = None if include_usage else False
        sse = lambda obj: f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
        finish = None
        try:
            first = self.kind.startswith("chat")
            if self.echo or first:
                yield sse(self._obj([self._choice(self.echo, None, True, first)], True, usage))
            while finish is None:
                ev = await self.q.get()
                finish = ev.finish_reason
                if finish == "error":
                    yield sse({"error": {"message": f"the model failed: {ev.error}", "type": "server_error",
                                         "param": None, "code": None}})
                    break
                if ev.text or finish or ev.logprobs or (self.ids_only and ev.tokens):
                    lp = self._logprobs(ev.tokens, ev.logprobs) if ev.logprobs else None
                    yield sse(self._obj([self._choice(ev.text, finish, True, logprobs=lp, tokens=ev.tokens)],
                                        True, usage))
            if include_usage:
                yield sse(self._obj([], True, self._usage()))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the task is cancelled) or the stream ended
            if finish is None:
                self.job.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
