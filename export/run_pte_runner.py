"""Run an exported `.pte` with ExecuTorch's stock LLM runner (`TextLLMRunner`), as a phone or
board would: the runner calls only `forward(tokens [1, 1], input_pos [1])`, feeds the prompt one
token at a time and reads `get_max_seq_len`/`get_eos_ids` from the program.

    shram-static export --format pte --out out/          # writes out/model.pte + out/tokenizer.json
    python export/run_pte_runner.py out/model.pte out/tokenizer.json --prompt "Hello" -n 32

The runner prints its own stats line (prefill/decode tokens per second) on stderr.
"""

import argparse
import json
import os
import sys
import tempfile


def byte_level_without_decoder(tokenizer_json: str, workdir: str):
    """For byte-level tokenizers: a copy of tokenizer.json without its decoder, and the map from
    each emitted vocab string back to bytes.

    Why: the runner's Python binding hands each decoded piece to the callback as `str` and raises
    UnicodeDecodeError on a piece that is not valid UTF-8 alone (any byte 128-255 of a multi-byte
    character). Without a decoder each piece is the token's printable vocab string, which maps
    back to its byte exactly; the bytes are joined and decoded once at the end.
    """
    with open(tokenizer_json, encoding="utf-8") as f:
        spec = json.load(f)
    if (spec.get("decoder") or {}).get("type") != "ByteLevel":
        return tokenizer_json, None
    from shram_static.tokenizer import bytes_to_unicode
    spec["decoder"] = None
    path = os.path.join(workdir, "tokenizer.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    to_bytes = {ch: bytes([b]) for b, ch in bytes_to_unicode().items()}
    to_bytes.update({t["content"]: b"" for t in spec.get("added_tokens", [])})
    return path, to_bytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pte", help="program written by `shram-static export --format pte`")
    p.add_argument("tokenizer", help="tokenizer.json written beside it")
    p.add_argument("--prompt", required=True)
    p.add_argument("-n", "--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; the runner accepts [0, 1]")
    args = p.parse_args(argv)
    for f in (args.pte, args.tokenizer):
        if not os.path.isfile(f):
            print(f"error: {f} does not exist", file=sys.stderr)
            return 2
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    with tempfile.TemporaryDirectory() as tmp:
        tok_path, to_bytes = byte_level_without_decoder(args.tokenizer, tmp)
        runner = TextLLMRunner(args.pte, tok_path)
        pieces = []
        cfg = GenerationConfig(echo=False, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, num_bos=1)
        runner.generate(args.prompt, cfg, token_callback=pieces.append)
    if to_bytes is None:
        print("".join(pieces))
    else:
        print(b"".join(to_bytes.get(s, s.encode()) for s in pieces).decode("utf-8", errors="replace"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
