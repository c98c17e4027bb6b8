"""The server's default limits on one request (`create_app`, `serve` flags); a leaf module, so the
CLI names them without importing the server."""

MAX_BODY_BYTES = 1 << 20  # 1 MiB: a prompt of the longest context with room to spare -> 413 beyond
MAX_STOP = 4  # stop strings per request, as OpenAI's API
MAX_STOP_CHARS = 64  # characters per stop string (each is looked for after every token)
