"""The server's metrics (`GET /metrics`) by `prometheus_client`: a registry per engine, every series
labelled with the served model's name."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest

FINISH_REASONS = ("stop", "length", "cancelled", "error")
# Bucket bounds in seconds, from a small model's decode step to a long request
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """The counters, gauges and histograms of one engine, in their own registry.

    Args:
        model: the `model` label of every series (`set_model` changes it before serving).
    """

    def __init__(self, model: str = ""):
        self.registry = CollectorRegistry()
        self._metrics = []

        def add(kind, name: str, doc: str, *labels: str, **kw):
            metric = kind(name, doc, ["model", *labels], registry=self.registry, **kw)
            self._metrics.append(metric)
            return metric

        self.requests = add(Counter, "shram_requests", "Requests finished, by finish_reason.",
                            "finish_reason")
        self.rejected = add(Counter, "shram_requests_rejected", "Requests refused with 429 (queue full).")
        self.invalid = add(Counter, "shram_requests_invalid", "Requests refused with 400 (bad input).")
        self.http_errors = add(Counter, "shram_http_errors", "Responses that were not a success, by status.",
                               "status")
        self.prompt_tokens = add(Counter, "shram_prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = add(Counter, "shram_generation_tokens", "Tokens generated.")
        self.queue_depth = add(Gauge, "shram_queue_depth", "Requests waiting for a row.")
        self.busy_rows = add(Gauge, "shram_busy_rows", "Rows serving a request.")
        self.batch_rows = add(Gauge, "shram_batch_rows", "Rows of the decoder (batch size).")
        self.row_steps = add(Counter, "shram_row_steps", "Rows stepped (steps x batch size).")
        self.busy_row_steps = add(Counter, "shram_busy_row_steps", "Rows stepped while serving a request.")
        self.step_seconds = add(Summary, "shram_step_seconds", "Time of the fixed-shape steps, by shape.",
                                "shape")
        self.ttft = add(Histogram, "shram_time_to_first_token_seconds",
                        "From a request's arrival to its first token.", buckets=FIRST_TOKEN_BUCKETS)
        self.itl = add(Histogram, "shram_inter_token_latency_seconds", "Between two tokens of one request.",
                       buckets=TOKEN_BUCKETS)
        self.latency = add(Histogram, "shram_request_latency_seconds", "From a request's arrival to its end.",
                           buckets=REQUEST_BUCKETS)
        self.queue_wait = add(Histogram, "shram_queue_wait_seconds",
                              "From a request's arrival to getting a row.", buckets=QUEUE_BUCKETS)
        self.set_model(model)

    def set_model(self, model: str) -> None:
        """Names the served model (the `model` label of every series)."""
        self.model = model
        for metric in self._metrics:  # no series of another name left behind
            metric.clear()
        for reason in FINISH_REASONS:  # every reason shows, 0 until it happens
            self.requests.labels(model, reason)
        for metric in self._metrics:
            if metric not in (self.requests, self.step_seconds, self.http_errors):
                metric.labels(model)
        # the children written after every step and token, looked up once
        self._tokens, self._ttft, self._itl, self._busy, self._rows, self._busy_rows = (
            m.labels(model) for m in (self.generation_tokens, self.ttft, self.itl, self.busy_rows,
                                      self.row_steps, self.busy_row_steps))
        self._steps = {k: self.step_seconds.labels(model, k) for k in ("decode", "prefill")}

    def observe_step(self, kind: str, seconds: float, busy: int, batch_size: int) -> None:
        """Records one step of `kind` ("decode" / "prefill") with `busy` of `batch_size` rows in use."""
        self._steps[kind].observe(seconds)
        self._busy.set(busy)
        self._rows.inc(batch_size)
        self._busy_rows.inc(busy)

    def observe_token(self, first: bool, seconds: float) -> None:
        """Records one generated token, `seconds` after the request's arrival (first) or previous token."""
        self._tokens.inc()
        (self._ttft if first else self._itl).observe(seconds)

    def observe_finish(self, reason: str, seconds: float) -> None:
        """Records a request that ended with `reason`, `seconds` after its arrival."""
        self.requests.labels(self.model, reason).inc()
        self.latency.labels(self.model).observe(seconds)

    def observe_admit(self, prompt_tokens: int, waited: float, queue_depth: int) -> None:
        """Records a request that got a row after `waited` seconds in the queue."""
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.queue_wait.labels(self.model).observe(waited)
        self.queue_depth.labels(self.model).set(queue_depth)

    def observe_http_error(self, status: int) -> None:
        """Records a response that was not a success (a 400 also as an invalid request)."""
        self.http_errors.labels(self.model, str(status)).inc()
        if status == 400:
            self.invalid.labels(self.model).inc()

    def observe_rejected(self) -> None:
        self.rejected.labels(self.model).inc()

    def value(self, name: str, **labels) -> float:
        """The current value of one sample, e.g. `value("shram_generation_tokens_total")` (0 if none yet)."""
        v = self.registry.get_sample_value(name, {"model": self.model, **labels})
        return 0.0 if v is None else v

    def render(self, queue_depth: int, busy_rows: int, batch_size: int) -> bytes:
        """The Prometheus text exposition (`CONTENT_TYPE_LATEST`), with the gauges set to the given values."""
        self.queue_depth.labels(self.model).set(queue_depth)
        self.busy_rows.labels(self.model).set(busy_rows)
        self.batch_rows.labels(self.model).set(batch_size)
        return generate_latest(self.registry)
