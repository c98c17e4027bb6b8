"""ASGI middleware around the app: every response that is not a success is an OpenAI error
object, and is counted (`Guard`, outermost); `BearerAuth` checks the API key on /v1/*.
"""

import logging
import secrets

from .limits import MAX_BODY_BYTES
from .schema import APIError

log = logging.getLogger("shram_static.serve")


class Guard:
    """ASGI middleware: body limit (413), JSON bodies (415; no Content-Type: JSON), bugs as 500s, counts.

    Args:
        app: the ASGI app.
        metrics: the engine's `Metrics` (`observe_http_error`).
        max_body_bytes: the largest request body accepted (a larger one gets 413).
    """

    def __init__(self, app, metrics, max_body_bytes: int = MAX_BODY_BYTES):
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def counted_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    self.metrics.observe_http_error(message["status"])
            await send(message)

        async def error(e: APIError) -> None:
            await e.response()(scope, receive, counted_send)

        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await error(self._too_large())
            return
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if scope["method"] == "POST" and not ctype:
            # WHY: recent FastAPI reads a body without a Content-Type as bytes; curl --data-binary sends none
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        elif scope["method"] == "POST" and ctype != b"application/json" and not ctype.endswith(b"+json"):
            await error(APIError(415, f"the request body must be JSON (Content-Type: application/json), got "
                                      f"{ctype.decode('latin-1')!r}", code="unsupported_media_type"))
            return
        # read whole up to the limit (a chunked body has no Content-Length), handed on as one message
        body, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # gone before sending its body
                return
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
            if sum(map(len, body)) > self.max_body_bytes:
                await error(self._too_large())
                return
        whole = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

        async def replay():
            return whole.pop() if whole else await receive()

        try:
            await self.app(scope, replay, counted_send)
        except Exception as e:  # a bug: the client still gets an error object, the log a traceback
            log.exception("unhandled error serving %s %s", scope["method"], scope["path"])
            if not started:
                await error(APIError(500, f"internal server error: {type(e).__name__}", type_="server_error"))

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_body_bytes} bytes "
                             f"(--max-body-bytes)", code="request_too_large")


class BearerAuth:
    """ASGI middleware: /v1/* requests need `Authorization: Bearer <api_key>` (else 401)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.key):
                e = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await e.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
