"""Readings of the machine and of a model for `shram-static bench`: memory read bandwidth, the bytes
a decode step must read, peak memory, stolen CPU time."""

import contextlib
import resource
import timeit

import torch
from torch import nn

from ..int_kernels import BLOCK, LANES
from ..layers import BEA


def bandwidth_buffer() -> torch.Tensor:
    """A 1 GiB fp32 buffer for `measure_bandwidth`, larger than any cache."""
    return torch.ones(2**28)


def measure_bandwidth(x: torch.Tensor | None = None, reps: int = 5) -> float:
    """Best-of-`reps` read bandwidth in bytes/s of `torch.sum` over `x` (default: a new buffer)."""
    x = bandwidth_buffer() if x is None else x
    x.sum()
    return x.numel() * x.element_size() / min(timeit.repeat(x.sum, number=1, repeat=reps))


def decode_read_bytes(model, batch_size: int, prefill_chunk: int, quantize: str | None = None,
                      compiled_ops: bool = False) -> int:
    """Bytes one decode step must read: the weights (B embedding rows, K experts), the cache rows attended.

    Args:
        model: the float `ShramForCausalLM` the step was built or exported from.
        batch_size, prefill_chunk: the step's B and C (the local ring holds window + C - 1 slots).
        quantize: None, or the weight quantization ("int8", "8da4w", "int4"): linear weights count
            as stored (`export/quantize.py`); norms, gates, the router and the state stay float.
        compiled_ops: under `quantize`, the layout of the compiled quantized decoders instead of
            the exporters': each linear as `int_kernels.pack` stores it (4 or 8 bits, outputs
            padded to blocks of 16, an fp16 scale per 32 inputs) and the experts as int8 with a
            scale per expert and output (`quantized_experts.Int8Experts`).
    """
    cfg = model.config
    es = next(model.parameters()).element_size()
    K = cfg.num_selected_heads
    group = 32  # export.quantize.GROUP (not imported: this module sits below the exporters)

    def linear(out: int, inp: int, expert: bool = False) -> float:
        if quantize is None:
            return out * inp * es
        if compiled_ops:
            if expert:
                return out * inp + out * es
            n, g = -(-out // LANES) * LANES, -(-inp // BLOCK)  # padded outputs, input blocks
            return n * g * BLOCK * (4 if quantize == "int4" else 8) / 8 + n * g * 2  # fp16 scales
        if quantize == "int4" or (quantize == "8da4w" and inp % group == 0 and not expert):
            return out * inp / 2 + out * (inp // group) * es
        return out * inp + out * es  # int8, one scale per output channel

    n = 0.0  # bytes
    linears = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    for m in model.modules():
        if isinstance(m, nn.Linear):
            n += linear(*m.weight.shape)
        elif isinstance(m, BEA):  # K of L experts: q, k, v (d -> u) and o (u -> d) each
            d, u = m.q_proj.shape[1], m.q_proj.shape[2]
            n += K * (3 * linear(u, d, expert=True) + linear(d, u, expert=True))
    for name, p in model.named_parameters():  # norms, gates, the router: in the model's dtype
        if name != "embed_tokens.weight" and id(p) not in linears and ".bea." not in name:
            n += p.numel() * es
    if model.lm_head is None:  # tied: the lm_head reads the whole table
        n += linear(*model.embed_tokens.weight.shape)
    n += batch_size * cfg.embedding_width * es  # the embedding rows
    ring = cfg.window_size + prefill_chunk - 1
    cache = 2 * batch_size * cfg.head_dim * (cfg.num_sliding_window_heads * ring
                                             + cfg.num_selected_heads * (cfg.mosrah_cache_length + 1))
    return int(n) + cfg.num_decoder_layers * cache * es


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB. WHY VmHWM first: Linux keeps `ru_maxrss` across
    fork + exec, so a worker would report its parent's peak too."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def cpu_times(path: str = "/proc/stat") -> tuple[int, int] | None:
    """(steal, total) CPU time of the whole machine in clock ticks, from /proc/stat (None if unreadable)."""
    fields = []
    with contextlib.suppress(OSError), open(path) as f:
        fields = f.readline().split()
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    return ticks[7], sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest in user)


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Share of the CPU time between two `cpu_times` readings that the hypervisor stole."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]), 3)


# Readings further apart than this (max / min) are two memory speeds, not noise
SPREAD_LIMIT = 1.5


def bandwidth_spread(readings: list[float]) -> str | None:
    """A warning when the bandwidth readings of one run spread beyond SPREAD_LIMIT (max / min).

    Args:
        readings: bytes/s, each from `measure_bandwidth`.

    Returns:
        The warning's text, or None.
    """
    if not readings or min(readings) <= 0 or max(readings) / min(readings) <= SPREAD_LIMIT:
        return None
    return (f"the bandwidth readings spread {max(readings) / min(readings):.1f}x: the memory ran at different "
            f"speeds during the run, and the steps do not follow it alike, so the ratios to the floor and "
            f"between backends depend on which speed each round met; compare runs whose readings stay "
            f"within {SPREAD_LIMIT}x")
