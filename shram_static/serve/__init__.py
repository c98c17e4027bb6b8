"""`shram-static serve`: continuous batching on the static state behind an OpenAI-compatible API
(`engine`, `app`, `server`, `cli`). FastAPI, uvicorn and prometheus_client are the `serve` extra."""
