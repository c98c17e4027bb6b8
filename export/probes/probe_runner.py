"""Probe 2: the stock ExecuTorch LLM runner (python binding of TextLLMRunner) on a toy .pte.

Run: python export/probes/probe_runner.py
Builds a byte-level HF tokenizer.json (ids 0..255 = bytes, BOS 256, EOS 257, PAD 258), exports a
toy step with V = 259 as `forward(tokens [1,1], input_pos [1]) -> logits [1, V]`, generates with
TextLLMRunner and compares the greedy tokens with the eager toy.
"""

import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_pte import build_generic  # noqa: E402


from shram_static.tokenizer import bytes_to_unicode  # noqa: E402  (the package's GPT-2 byte map)


def byte_tokenizer_json(bos=256, eos=257, pad=258, decoder=True):
    """HF tokenizer.json: 256 byte tokens (id == byte value) + BOS/EOS/PAD added tokens."""
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    special = [(bos, "<|bos|>"), (eos, "<|eos|>"), (pad, "<|pad|>")]
    for i, s in special:
        vocab[s] = i
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, s in special],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": ({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
                    if decoder else None),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def main():
    tmp = tempfile.mkdtemp()
    tok_path = os.path.join(tmp, "tokenizer.json")
    with open(tok_path, "w") as f:
        json.dump(byte_tokenizer_json(), f, ensure_ascii=False)
    # the HF tokenizers library agrees: ids == bytes
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(tok_path)
    text = "héllo, wörld"
    ids = hf.encode(text).ids
    assert ids == list(text.encode()), ids
    assert hf.decode(ids) == text

    pte = os.path.join(tmp, "toy.pte")
    step, et, state = build_generic(pte, C=8, V=259, T=64, eos_ids=[257])

    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    # WHY a second, decoder-less tokenizer.json: the python binding converts each decoded piece to
    # `str` and raises UnicodeDecodeError on a lone non-UTF-8 byte (ids 128..255); without a
    # decoder a piece is the token's vocab string (one GPT-2 printable char), which maps back to
    # its id exactly.  Encoding (prompt ids) is identical.
    ids_tok_path = os.path.join(tmp, "tokenizer_ids.json")
    with open(ids_tok_path, "w") as f:
        json.dump(byte_tokenizer_json(decoder=False), f, ensure_ascii=False)
    u2b = {c: b for b, c in bytes_to_unicode().items()}
    u2b.update({"<|bos|>": 256, "<|eos|>": 257, "<|pad|>": 258})
    runner = TextLLMRunner(pte, ids_tok_path if "--ids" in sys.argv else tok_path)
    print("runner:", runner, "vocab", runner.get_vocab_size())

    prompt = "hi there"
    n_new = 12

    def eager_greedy(prompt_ids, n):
        # the runner feeds the prompt one token at a time at positions 0,1,...; the last sampled
        # token is NOT fed back, so `n` tokens need len(prompt)+n-1 forward calls
        state.cache_k.zero_(); state.cache_v.zero_(); state.taken.zero_()
        out = []
        with torch.no_grad():
            pos = 0
            for t in prompt_ids:
                lg = step(torch.tensor([[t]]), torch.tensor([pos]), torch.ones(1, 1, dtype=torch.bool))[0, -1]
                pos += 1
            for _ in range(n):
                nxt = int(lg.argmax())
                out.append(nxt)
                if nxt == 257:
                    break
                lg = step(torch.tensor([[nxt]]), torch.tensor([pos]), torch.ones(1, 1, dtype=torch.bool))[0, -1]
                pos += 1
        return out

    ref = eager_greedy(list(prompt.encode()), n_new)
    for attempt in range(2):
        pieces, stats = [], []
        cfg = GenerationConfig(echo=False, max_new_tokens=n_new, temperature=0.0, seq_len=-1, num_bos=0, num_eos=0)
        try:
            runner.generate(prompt, cfg, token_callback=pieces.append, stats_callback=stats.append)
        except Exception as e:  # noqa: BLE001
            print("generate FAILED:", type(e).__name__, e)
        print(f"run {attempt}: pieces={pieces!r}")
        if "--ids" in sys.argv:
            got = [u2b[p] for p in pieces]
        else:
            got = [b for p in pieces for b in p.encode("utf-8", "surrogateescape")]
        print(f"  eager ref ids {ref}")
        print(f"  runner text -> ids {got} match={got == ref[:len(got)] and len(got) == len(ref)}")
        if stats:
            s = stats[0]
            print(f"  stats: prompt={s.num_prompt_tokens} generated={s.num_generated_tokens}")
        runner.reset()


if __name__ == "__main__":
    main()
