"""Toy step module with the same interface as the real SHRAM static step (shared by the probes).

State (registered buffers, all written in place):
  * ``taken (B, L)`` bool: a per-row bit set, read as all False at the start of a "block"
    (``pos % L == 0``), so a step handed position 0 needs no clearing (like SHRAM's router).
  * ``cache_k``, ``cache_v`` ``(B*(T+1), d)`` float: one row per (batch row, position); row
    ``b*(T+1)+T`` is a write sink for dead tokens that is never read.  Written with
    ``index_put_((rows,), vals)`` with ONE 1-D int64 index (TOOLCHAIN_NOTES: the only form that
    survives ExecuTorch's reinplace pass and becomes ScatterND in ONNX).

``ToyStep.forward(tokens (B,C) int64, input_pos (B,) int64, live (B,C) bool) -> logits (B,C,V)``.
``ToyFunctional.forward(tokens, input_pos, live, *state) -> (logits, *new_state)`` is the pure
(out-of-place) twin used for ONNX.
"""

import torch
from torch import nn

STATE_NAMES = ("taken", "cache_k", "cache_v")


def _step(mod, tokens, input_pos, live, taken, cache_k, cache_v, inplace):
    B, C = tokens.shape
    T, L, d = mod.T, mod.L, mod.d
    livei = live.to(torch.int64)
    pos = input_pos[:, None] + torch.cumsum(livei, dim=1) - livei          # (B, C) position of each token
    posc = pos.clamp(0, T - 1)
    base = torch.arange(B, dtype=torch.int64)[:, None] * (T + 1)
    rows = torch.where(live, base + posc, base + T).reshape(-1)             # dead -> sink row

    x = mod.emb(tokens)                                                     # (B, C, d)
    # "taken" read as all False at block start, derived from input_pos only
    fresh = (input_pos % L) == 0                                            # (B,)
    taken_eff = taken & ~fresh[:, None]
    x = x + mod.tw(taken_eff.to(x.dtype))[:, None, :]

    k = mod.k(x).reshape(B * C, d)
    v = mod.v(x).reshape(B * C, d)
    if inplace:
        cache_k.index_put_((rows,), k)
        cache_v.index_put_((rows,), v)
        new_k, new_v = cache_k, cache_v
    else:
        new_k = cache_k.index_put((rows,), k)
        new_v = cache_v.index_put((rows,), v)
    keys = new_k.view(B, T + 1, d)[:, :T]                                   # sink never read
    vals = new_v.view(B, T + 1, d)[:, :T]
    q = mod.q(x)
    s = q @ keys.transpose(1, 2) / d ** 0.5                                 # (B, C, T)
    slot = torch.arange(T, dtype=torch.int64)
    mask = slot[None, None, :] <= pos[:, :, None]
    p = torch.softmax(torch.where(mask, s, torch.full_like(s, -1e30)), dim=-1) * mask.any(-1, keepdim=True)
    y = p @ vals
    logits = mod.o(mod.mlp(x + y))

    # taken |= bit (pos % L) of every live token (block restarts are handled by the read rule)
    hit = ((pos % L)[:, :, None] == torch.arange(L)[None, None, :]) & live[:, :, None]
    new_taken = taken_eff | hit.any(dim=1)
    if inplace:
        taken.copy_(new_taken)
        return logits, taken, new_k, new_v
    return logits, new_taken, new_k, new_v


class ToyCore(nn.Module):
    def __init__(self, V=64, d=32, T=24, L=4, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.V, self.d, self.T, self.L = V, d, T, L
        self.emb = nn.Embedding(V, d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.tw = nn.Linear(L, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))
        self.o = nn.Linear(d, V, bias=False)


class ToyState(nn.Module):
    def __init__(self, core, B):
        super().__init__()
        self.register_buffer("taken", torch.zeros(B, core.L, dtype=torch.bool))
        self.register_buffer("cache_k", torch.zeros(B * (core.T + 1), core.d))
        self.register_buffer("cache_v", torch.zeros(B * (core.T + 1), core.d))

    def names(self):
        return list(STATE_NAMES)


class ToyStep(nn.Module):
    def __init__(self, core, state):
        super().__init__()
        self.core, self.state = core, state

    def forward(self, tokens, input_pos, live):
        s = self.state
        return _step(self.core, tokens, input_pos, live, s.taken, s.cache_k, s.cache_v, True)[0]


class ToyFunctional(nn.Module):
    def __init__(self, core, state):
        super().__init__()
        self.core, self.names = core, state.names()

    def forward(self, tokens, input_pos, live, *state):
        out = _step(self.core, tokens, input_pos, live, *state, inplace=False)
        return out
