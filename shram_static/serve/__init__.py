"""`shram-static serve`: continuous batching on the static state behind an OpenAI-compatible API.

- `engine.Engine`: the decoder's B rows serve B requests at once, in one background thread;
- `app.create_app`: the FastAPI (ASGI) app over one engine (`schema`: request bodies and
  errors, `text`: streamed text, `metrics`: Prometheus counters);
- `server`: uvicorn with a draining shutdown; `cli`: the `serve` and `bench-serve`
  subcommands; `bench`: the serving benchmark.

FastAPI and uvicorn are the `serve` extra: `pip install shram_static[serve]`.
"""
