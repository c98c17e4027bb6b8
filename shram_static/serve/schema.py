"""OpenAI request bodies (pydantic, strict) and OpenAI-style error objects. Every OpenAI field is
honoured or refused (only the values served are admitted); unknown fields are refused, as OpenAI does."""

from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from ..sampling import BIAS_LIMIT, PENALTY_LIMIT


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` object.

    Args:
        status: HTTP status (400, 401, 429, 503, ...).
        message: what is wrong and what to do about it.
        param: the request field it is about (None: the request as a whole).
        type_, code: OpenAI's error type and code (None: none).
        headers: extra response headers (e.g. Retry-After).
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type_, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


# OpenAI request fields taken only in the values served: what a refused value gets told
UNSUPPORTED = {
    "n": "one choice per request: n can only be 1 (send several requests)",
    "best_of": "one completion per request: best_of can only be 1",
    "suffix": "no insertion: suffix can only be empty",
    "tools": "no function calling: tools can only be null",
    "tool_choice": "no function calling: tool_choice can only be 'none'",
    "functions": "no function calling: functions can only be null",
    "function_call": "no function calling: function_call can only be 'none'",
    "response_format": "no JSON mode or JSON schema: response_format can only be {'type': 'text'}",
    "audio": "text output only: audio can only be null",
    "modalities": "text output only: modalities can only be ['text']",
    "prediction": "no predicted outputs: prediction can only be null",
    "web_search_options": "no web search: web_search_options can only be null",
    "reasoning_effort": "this model does not reason: reasoning_effort can only be null",
    "verbosity": "no verbosity setting: verbosity can only be null",
    "store": "no stored completions: store can only be false",
    "service_tier": "one service tier: service_tier can only be 'auto' or 'default'",
}


def validation_error(errors: list[dict]) -> APIError:
    """A 400 `APIError` for pydantic / FastAPI validation errors (the first one), `param` its field."""
    e = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [p for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}")
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {e['msg']}")
    param = str(loc[0])
    where = ".".join(str(p) for p in loc if not (isinstance(p, str) and "[" in p))  # no union tags
    if param in UNSUPPORTED:
        return APIError(400, f"'{param}' is not supported with this value ({UNSUPPORTED[param]})", param,
                        code="unsupported_parameter")
    if e.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request field '{where}': this server does not support it",
                        param, code="unknown_parameter")
    if e.get("type") == "missing":
        return APIError(400, f"'{where}' is required", param)
    if len(errors) > 1 and all(str(x.get("loc", ("", ""))[1:2]) == str(e["loc"][1:2]) for x in errors):
        # a union field (prompt, stop, content): every alternative failed
        return APIError(400, f"'{param}' has the wrong type or value: {e['msg']} (and {len(errors) - 1} "
                             f"other alternatives failed)", param)
    return APIError(400, f"'{where}': {e['msg']}", param)


def _unicode(s: str) -> str:
    """WHY: JSON can hold a lone surrogate ("\\ud800"), which no tokenizer or UTF-8 response encodes."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode text (it holds a lone surrogate)") from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]  # a str that is valid Unicode


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None


TokenId = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")]  # a token id, as JSON keys are
Bias = Annotated[float, Field(ge=-BIAS_LIMIT, le=BIAS_LIMIT)]


class _Sampling(_Strict):
    """Fields shared by completions and chat completions (None: the server's default)."""

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=-2**63, lt=2**64)
    stop: Text | list[Text] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1)
    # adjustments of each step's logits (sampling.Sampler); repetition_penalty: vLLM's and llama.cpp's
    logit_bias: dict[TokenId, Bias] | None = None
    presence_penalty: float | None = Field(None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: float | None = Field(None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    repetition_penalty: float | None = Field(None, gt=0, le=1e6)
    user: Text | None = None  # an end-user id: accepted, it changes nothing

    def stops(self) -> list[str]:
        s = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [x for x in s if x]


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: one prompt, as text or token ids."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1, le=1)
    suffix: Annotated[str, Field(max_length=0)] | None = None


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Text
    content: Text | list[dict] | None = None


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions` (needs a tokenizer with a chat template)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # refused unless absent or a value that asks for nothing this server lacks (UNSUPPORTED)
    tools: None = None
    tool_choice: Literal["none"] | None = None
    functions: None = None
    function_call: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None  # no tools: nothing to call in parallel either way
    response_format: ResponseFormat | None = None
    audio: None = None
    modalities: list[Literal["text"]] | None = None
    prediction: None = None
    web_search_options: None = None
    reasoning_effort: None = None
    verbosity: None = None
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # labels and ids: accepted, they change nothing
    metadata: dict[Text, Text] | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
