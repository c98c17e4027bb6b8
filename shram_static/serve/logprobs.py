"""The `logprobs` objects of OpenAI's responses, of the model's raw logits (before bias, penalties and
temperature, as vLLM); a token's text is its decoded text alone (U+FFFD for part of a character)."""

import itertools

__all__ = ["chat_logprobs", "completion_logprobs"]


def completion_logprobs(tokenizer, tokens: list[int], lps: list, offset: int) -> tuple[dict, int]:
    """Completions' `logprobs` object of some generated tokens.

    Args:
        tokenizer: has `decode(list[int]) -> str`.
        tokens: the generated token ids.
        lps: per token, (its logprob, {token id: logprob} of the top tokens).
        offset: the text offset of the first token (the length of the text before it).

    Returns:
        ({"tokens", "token_logprobs", "top_logprobs", "text_offset"}, the offset after them); each
        `top_logprobs` entry holds the sampled token too, as OpenAI's legacy completions.
    """
    texts = [tokenizer.decode([i]) for i in tokens]
    offsets = list(itertools.accumulate(map(len, texts), initial=offset))
    # as OpenAI: the top tokens, and the sampled one if not among them; one text keeps its largest logprob
    tops = []
    for text, (c, top) in zip(texts, lps):
        tops.append({})
        for i, v in top.items():  # largest first
            tops[-1].setdefault(tokenizer.decode([i]), v)
        tops[-1].setdefault(text, c)
    return {"tokens": texts, "token_logprobs": [c for c, _ in lps], "top_logprobs": tops,
            "text_offset": offsets[:-1]}, offsets[-1]


def chat_logprobs(tokenizer, tokens: list[int], lps: list) -> dict:
    """Chat completions' `logprobs` object of some generated tokens (arguments as `completion_logprobs`)."""

    def entry(i: int, lp: float) -> dict:
        text = tokenizer.decode([i])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(i, c), "top_logprobs": [entry(j, v) for j, v in top.items()]}
                        for i, (c, top) in zip(tokens, lps)], "refusal": None}
