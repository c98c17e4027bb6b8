"""`shram-static serve`: continuous batching on the static state behind an OpenAI-compatible API.

- `engine.Engine`: the decoder's B rows serve B requests at once, in one background thread;
- `app.create_app`: the FastAPI (ASGI) app over one engine (`schema`: request bodies and
  errors, `guard`: every error an OpenAI error object and counted, the body limit, `limits`:
  the default limits, `text`: streamed text, `logprobs`: OpenAI's logprobs objects, `metrics`:
  Prometheus metrics by prometheus_client);
- `server`: uvicorn with a draining shutdown; `cli`: the `serve` and `bench-serve`
  subcommands; `bench`: the serving benchmark.

FastAPI, uvicorn and prometheus_client are the `serve` extra: `pip install shram_static[serve]`.
"""
