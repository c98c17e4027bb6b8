"""OpenAI request bodies (pydantic) and OpenAI-style error objects.

Types are strict (a string is not a number, 1 is not a bool), unknown fields are ignored as
OpenAI-compatible servers do, and every error names the request field it is about.
"""

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` object.

    Args:
        status: HTTP status (400, 401, 429, 503, ...).
        message: what is wrong and what to do about it.
        param: the request field it is about (None: the request as a whole).
        type_: OpenAI's error type.
        code: OpenAI's error code (None when it has none).
        headers: extra response headers (e.g. Retry-After).
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type_, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def validation_error(errors: list[dict]) -> APIError:
    """A 400 `APIError` for pydantic / FastAPI validation errors (the first one is reported).

    Its `param` is the request field (the first key after "body"), e.g. "max_tokens".
    """
    e = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [p for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}")
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {e['msg']}")
    param = str(loc[0])
    where = ".".join(str(p) for p in loc if not (isinstance(p, str) and "[" in p))  # no union tags
    if e.get("type") == "missing":
        return APIError(400, f"'{where}' is required", param)
    if len(errors) > 1 and all(str(x.get("loc", ("", ""))[1:2]) == str(e["loc"][1:2]) for x in errors):
        # a union field (prompt, stop, content): every alternative failed
        return APIError(400, f"'{param}' has the wrong type or value: {e['msg']} (and {len(errors) - 1} "
                             f"other alternatives failed)", param)
    return APIError(400, f"'{where}': {e['msg']}", param)


def _unicode(s: str) -> str:
    """WHY: JSON can hold a lone surrogate ("\\ud800"), which Python keeps in a str but which no
    tokenizer or UTF-8 response can encode."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode text (it holds a lone surrogate)") from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]  # a str that is valid Unicode


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = None


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

    def stops(self) -> list[str]:
        s = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [x for x in s if x]


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: one prompt, as text or token ids."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Text
    content: Text | list[dict] | None = None


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions` (needs a tokenizer with a chat template)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None  # not supported: true gets a 400 (never silently ignored)
