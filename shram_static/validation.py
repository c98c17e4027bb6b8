"""Input checks shared by every entry point (the model's forward, `HostDecoder`, `generate`).

Each runs on the host before anything changes state, so a call that fails leaves every cache
and decoder exactly as it was.
"""

import torch

from .errors import CapacityError

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)
SMALL = 256  # the most values a host check reads as Python ints (`_ids_in_range`, `HostDecoder._check_capacity`, `RowCounts.fed`)


def check_positive_ints(**named) -> None:
    """Raises ValueError naming the first of `named` that is not an int >= 1 (a bool is not)."""
    for name, v in named.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def check_verify_len(verify_len) -> None:
    """Raises ValueError unless verify_len (tokens per row of a verify step) is an int >= 2 or None."""
    if verify_len is not None and (isinstance(verify_len, bool) or not isinstance(verify_len, int) or verify_len < 2):
        raise ValueError(f"verify_len must be an int >= 2 or None, got {verify_len!r}")


def check_input_ids(input_ids: torch.Tensor, vocab_size: int, name: str = "input_ids") -> None:
    """Raises TypeError/ValueError unless input_ids is an integer tensor with ids in [0, V)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must hold integer token ids (int64), got dtype {input_ids.dtype}")
    if input_ids.numel() and not _ids_in_range(input_ids, vocab_size):
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab_size)]
        raise ValueError(f"{name} holds ids outside the vocabulary [0, {vocab_size}): "
                         f"{bad[:8].tolist()}")


def _ids_in_range(ids: torch.Tensor, vocab_size: int) -> bool:
    """Whether every id of a nonempty integer tensor lies in [0, vocab_size).

    WHY Python for a few ids: `tolist` reads them without a dispatched torch op, and each of
    those costs microseconds right after a step (the step evicted the host code's caches)."""
    if ids.numel() <= SMALL and ids.device.type == "cpu":
        v = ids.tolist()
        for _ in range(ids.dim() - 1):
            v = [x for row in v for x in row]
        v = v if ids.dim() else [v]
        return min(v) >= 0 and max(v) < vocab_size
    return int(ids.min()) >= 0 and int(ids.max()) < vocab_size


def check_mask(mask: torch.Tensor | None, shape: torch.Size, name: str = "attention_mask") -> torch.Tensor | None:
    """Validates a 0/1 mask of the given shape and returns it as bool (None stays None)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"{name} must have the shape of the ids {tuple(shape)}, got {tuple(mask.shape)}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"{name} must be bool or integer 0/1, got dtype {mask.dtype}")
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name} must hold only 0 and 1")
    return mask.bool()


def check_capacity(need: torch.Tensor, capacity: int, detail: str = "",
                   advice: str = "build the model with a larger inference_sequence_length") -> None:
    """Raises CapacityError if any row would hold more than `capacity` live tokens.

    Args:
        need: (B,) live tokens each row would hold after the call.
        capacity: S, the live tokens a row can hold (`inference_sequence_length`).
        detail: what `need` is made of, e.g. " (12 cached + 4 new)", put after the count.
        advice: what the caller can do about it, ending the message.
    """
    over = need > capacity
    if bool(over.any()):
        rows = torch.nonzero(over).flatten().tolist()
        raise CapacityError(f"rows {rows[:8]} would hold {int(need.max())} live tokens{detail}, more than "
                            f"the capacity of {capacity} per row (inference_sequence_length); {advice}")
