"""The server's counters and their Prometheus text exposition (`GET /metrics`).

Counters are plain numbers written by the engine thread and read by the server thread: each
read sees some recent value, which is all a scrape needs.
"""


class Metrics:
    """Counters of one engine (one model, one process)."""

    def __init__(self):
        self.finished: dict[str, int] = {}  # finish_reason -> requests
        self.rejected = 0  # 429: the queue was full
        self.invalid = 0  # 400: bad input
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.queue_depth = 0
        self.busy_rows = 0
        self.steps = {"decode": 0, "prefill": 0}
        self.step_seconds = {"decode": 0.0, "prefill": 0.0}
        self.row_steps = 0  # sum over steps of B
        self.busy_row_steps = 0  # sum over steps of rows holding a request
        self.ttft_seconds = 0.0
        self.ttft_count = 0

    def observe_step(self, kind: str, seconds: float, busy: int, batch_size: int) -> None:
        """Records one step of `kind` ("decode" / "prefill") with `busy` of `batch_size` rows in use."""
        self.steps[kind] += 1
        self.step_seconds[kind] += seconds
        self.busy_rows = busy
        self.row_steps += batch_size
        self.busy_row_steps += busy

    def observe_first_token(self, seconds: float) -> None:
        """Records one request's time from submission to its first token."""
        self.ttft_seconds += seconds
        self.ttft_count += 1

    def render(self, queue_depth: int, busy_rows: int, batch_size: int, model: str) -> str:
        """Prometheus text format (version 0.0.4)."""
        lab = f'model="{model}"'
        out = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP shram_{name} {help_}")
            out.append(f"# TYPE shram_{name} {kind}")
            for labels, value in samples:
                out.append(f"shram_{name}{{{','.join([lab, *labels])}}} {value}")

        reasons = {r: self.finished.get(r, 0) for r in ("stop", "length", "cancelled", "error")}
        metric("requests_total", "counter", "Requests finished, by finish_reason.",
               [([f'finish_reason="{r}"'], n) for r, n in reasons.items()])
        metric("requests_rejected_total", "counter", "Requests refused with 429 (queue full).",
               [([], self.rejected)])
        metric("requests_invalid_total", "counter", "Requests refused with 400 (bad input).",
               [([], self.invalid)])
        metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [([], self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated.", [([], self.generation_tokens)])
        metric("queue_depth", "gauge", "Requests waiting for a row.", [([], queue_depth)])
        metric("busy_rows", "gauge", "Rows serving a request.", [([], busy_rows)])
        metric("batch_rows", "gauge", "Rows of the decoder (batch size).", [([], batch_size)])
        metric("row_steps_total", "counter", "Rows stepped (steps x batch size).", [([], self.row_steps)])
        metric("busy_row_steps_total", "counter", "Rows stepped while serving a request.",
               [([], self.busy_row_steps)])
        out.append("# HELP shram_step_seconds Time of the fixed-shape steps, by shape.")
        out.append("# TYPE shram_step_seconds summary")
        for k in ("decode", "prefill"):
            out.append(f'shram_step_seconds_sum{{{lab},shape="{k}"}} {self.step_seconds[k]:.6f}')
            out.append(f'shram_step_seconds_count{{{lab},shape="{k}"}} {self.steps[k]}')
        out.append("# HELP shram_time_to_first_token_seconds From a request's arrival to its first token.")
        out.append("# TYPE shram_time_to_first_token_seconds summary")
        out.append(f"shram_time_to_first_token_seconds_sum{{{lab}}} {self.ttft_seconds:.6f}")
        out.append(f"shram_time_to_first_token_seconds_count{{{lab}}} {self.ttft_count}")
        return "\n".join(out) + "\n"
