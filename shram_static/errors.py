"""The package's own exceptions, each a `ValueError` a caller can catch by name (a leaf module:
it imports nothing of the package)."""


class CapacityError(ValueError):
    """A row would hold more live tokens than the decoder's capacity."""


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: the message says which file or key."""


class ExportFormatError(ValueError):
    """A file that is not a loadable export of this package (truncated, corrupt, foreign, or
    from another export); a missing file raises FileNotFoundError instead."""


class NonFiniteLogitsError(ValueError):
    """A step produced NaN or Inf logits for a live token; nothing was sampled. The step had run
    (the decoder holds its tokens); `reset()` or `reset_rows` starts over.

    Attributes:
        rows: the rows with a non-finite logit at a live token.
        logits: the step's logits; the other rows' are valid.
    """

    def __init__(self, message: str, rows=(), logits=None):
        super().__init__(message)
        self.rows = list(rows)
        self.logits = logits
