"""Incremental text of one generated sequence: a tail that ends in U+FFFD (an incomplete character)
or could still become a stop string is held back, so a streamed delta is never taken back."""


class TextStream:
    """The text of the tokens generated so far, released as safe deltas.

    Args:
        tokenizer: has `decode(list[int]) -> str` (special ids skipped).
        stop: strings that end the text (excluded from it), as OpenAI's `stop`.
        eos_token_id: id that ends the text (None: never).
    """

    def __init__(self, tokenizer, stop: list[str] | None = None, eos_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.eos_token_id = eos_token_id
        self.tokens: list[int] = []  # generated tokens before EOS
        self.text = ""  # final text once `stopped`, else the text released so far
        self.stopped = False

    def push(self, token: int) -> str:
        """Adds one generated token; returns the newly released text ('' if held back or `stopped`)."""
        if self.stopped:
            return ""
        if token == self.eos_token_id:
            self.stopped = True
            return ""
        self.tokens.append(int(token))
        full = self.tokenizer.decode(self.tokens)
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        cut = min((i for i in (full.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(full[:cut])
        end = len(full)
        while end > len(self.text) and full[end - 1] == "\ufffd":  # an incomplete character
            end -= 1
        # a tail that may still grow into a stop string waits
        end -= max((k for s in self.stop for k in range(1, min(len(s), end - len(self.text) + 1))
                    if full[end - k:end] == s[:k]), default=0)
        return self._release(full[:end])

    def flush(self) -> str:
        """Releases everything held back (the sequence ended without a stop)."""
        return "" if self.stopped else self._release(self.tokenizer.decode(self.tokens))

    def _release(self, text: str) -> str:
        if not text.startswith(self.text):  # never happens for prefix-stable decoders
            return ""
        delta, self.text = text[len(self.text):], text
        return delta
