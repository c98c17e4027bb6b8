"""Slow, deliberately plain REFERENCE implementation of the SHRAM forward (docs/design.md, "What SHRAM computes").

Used only by the tests as an oracle. It is independent of the ``shram_static`` package: it
imports only torch, math, json and safetensors. Everything is computed in float64 with plain
Python loops over rows, tokens and heads, trading speed for obviousness.

Semantics (docs/design.md, "What SHRAM computes", confirmed against the golden cases in tests/data):
  * Each row is processed on its own, on its live tokens only (padding is a no-op, A.4).
    The position of a live token is the number of live tokens before it in its row.
  * Local path: H heads of width u, default RoPE (local_rope_theta) at the token position,
    scale 1/sqrt(u), keys = live tokens at positions p-window+1 .. p.
  * Router: z = x @ routing_weight.T, scores = entmax-1.2 by bisection (A.6);
    block-balanced top-K selection in blocks of W = L//K tokens from the row's first live
    token; P = scores[sel] / max(sum, tiny).
  * BEA per selected expert head with YaRN RoPE (A.7); positions are the token position
    (main_sequence) or the index of the token within its expert's sequence
    (semantic_sequence). Attention scale A/sqrt(u), A = (0.1*ln(s)+1)^2.
"""

import json
import math
import os

import torch
from safetensors.torch import load_file

DTYPE = torch.float64

CONFIG_DEFAULTS = {
    "vocab_size": 50277,
    "embedding_width": 512,
    "mlp_width": 1366,
    "num_decoder_layers": 12,
    "num_sliding_window_heads": 16,
    "num_mosrah_heads": 16,
    "num_selected_heads": 16,
    "head_dim": 16,
    "window_size": 128,
    "rope_mode": "main_sequence",
    "rms_norm_eps": 1e-5,
    "local_rope_theta": 10000.0,
    "mosrah_rope_theta": 10000.0,
    "training_sequence_length": 1024,
    "inference_sequence_length": None,  # defaults to training_sequence_length
    "alpha": 1.0,
    "beta": 32.0,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "use_residual_gate": True,
}


# ----------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------

def load_checkpoint(dirpath):
    """Return (config dict with the defaults of docs/design.md, "Config", filled in, state dict as float64)."""
    with open(os.path.join(dirpath, "config.json")) as f:
        raw = json.load(f)
    cfg = dict(CONFIG_DEFAULTS)
    cfg.update(raw)
    if cfg["inference_sequence_length"] is None:
        cfg["inference_sequence_length"] = cfg["training_sequence_length"]
    sd = load_file(os.path.join(dirpath, "model.safetensors"))
    sd = {k: v.to(DTYPE) for k, v in sd.items()}
    return cfg, sd


# ----------------------------------------------------------------------------------------
# Small building blocks
# ----------------------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    """x: (d,). x * rsqrt(mean(x^2) + eps) * weight."""
    return x * (1.0 / math.sqrt(float((x * x).mean()) + eps)) * weight


def default_rope_freqs(u, base):
    """theta_i = base^(-2i/u), i = 0..u/2-1, as a list of floats."""
    return [base ** (-2.0 * i / u) for i in range(u // 2)]


def yarn_rope_freqs(u, base, s, C, alpha, beta):
    """YaRN-adjusted frequencies (docs/design.md, "RoPE and YaRN")."""
    out = []
    for theta in default_rope_freqs(u, base):
        r = C * theta / (2.0 * math.pi)
        gamma = min(max((r - alpha) / (beta - alpha), 0.0), 1.0)
        out.append((1.0 - gamma) * theta / s + gamma * theta)
    return out


def apply_rope(v, pos, freqs):
    """Rotate-half RoPE of a single head vector v (u,) at integer position pos."""
    half = len(freqs)
    angles = torch.tensor([pos * f for f in freqs], dtype=DTYPE)
    cos = torch.cat([angles.cos(), angles.cos()])
    sin = torch.cat([angles.sin(), angles.sin()])
    rotated = torch.cat([-v[half:], v[:half]])  # rotate_half
    return v * cos + rotated * sin


def attend(q, keys, values, scale):
    """Single-query attention: q (u,), keys/values lists of (u,) tensors."""
    logits = torch.stack([scale * torch.dot(q, k) for k in keys])
    w = torch.softmax(logits, dim=0)
    out = torch.zeros_like(values[0])
    for wj, vj in zip(w, values):
        out = out + wj * vj
    return out


def entmax_bisect_12(z):
    """entmax with alpha = 1.2 by bisection, exactly as docs/design.md, "Routing"; z is a list of floats.

    p_i(tau) = max(0.2*z_i - tau, 0) ** 5.  50 halvings; the result is the p of the last
    tau_m, divided by its sum.
    """
    a1 = 0.2  # alpha - 1
    L = len(z)
    x = [a1 * zi for zi in z]
    mx = max(x)
    tau_lo = mx - 1.0
    tau_hi = mx - (1.0 / L) ** a1
    dm = tau_hi - tau_lo
    p = None
    for _ in range(50):
        dm = dm / 2.0
        tau_m = tau_lo + dm
        p = [max(xi - tau_m, 0.0) ** (1.0 / a1) for xi in x]
        if sum(p) >= 1.0:
            tau_lo = tau_m
    total = sum(p)
    return [pi / total for pi in p]


# ----------------------------------------------------------------------------------------
# One row
# ----------------------------------------------------------------------------------------

def _layer_params(sd, i):
    pre = f"model.layers.{i}."
    return {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}


def _row_forward(cfg, sd, ids):
    """ids: list of live token ids of one row. Returns (logits (n, V), selected list per layer
    of n lists of K ints)."""
    n = len(ids)
    d = cfg["embedding_width"]
    H = cfg["num_sliding_window_heads"]
    L = cfg["num_mosrah_heads"]
    K = cfg["num_selected_heads"]
    u = cfg["head_dim"]
    W = L // K
    window = cfg["window_size"]
    eps = cfg["rms_norm_eps"]
    num_layers = cfg["num_decoder_layers"]
    c_train = cfg["training_sequence_length"]
    s = cfg["inference_sequence_length"] / c_train
    A = (0.1 * math.log(s) + 1.0) ** 2
    semantic = cfg["rope_mode"] == "semantic_sequence"
    if semantic:
        yarn_C = math.ceil(c_train * K / L) + W  # mosrah_packed_length
    else:
        yarn_C = c_train
    local_freqs = default_rope_freqs(u, cfg["local_rope_theta"])
    mosrah_freqs = yarn_rope_freqs(u, cfg["mosrah_rope_theta"], s, yarn_C,
                                   cfg["alpha"], cfg["beta"])
    tiny = torch.finfo(torch.float32).tiny

    embed = sd["embed_tokens.weight"]
    lm_head = sd.get("lm_head.weight", embed)

    xs = [embed[t].clone() for t in ids]  # residual stream, list of (d,)
    selected_all = []

    for li in range(num_layers):
        p = _layer_params(sd, li)
        if "attn_residual_scale" in p:
            g_attn = float(p["attn_residual_scale"].reshape(-1)[0])
            g_mlp = float(p["mlp_residual_scale"].reshape(-1)[0])
        else:  # only possible for use_residual_gate=False
            g_attn = g_mlp = 1.0 / math.sqrt(num_layers)

        hs = [rms_norm(x, p["attn_norm.weight"], eps) for x in xs]

        # ---- local sliding-window path -------------------------------------------------
        Wq = p["attention.local_attention.q_proj.weight"]
        Wk = p["attention.local_attention.k_proj.weight"]
        Wv = p["attention.local_attention.v_proj.weight"]
        Wo = p["attention.local_attention.o_proj.weight"]
        lq, lk, lv = [], [], []
        for t in range(n):
            q = (Wq @ hs[t]).reshape(H, u)
            k = (Wk @ hs[t]).reshape(H, u)
            v = (Wv @ hs[t]).reshape(H, u)
            lq.append([apply_rope(q[h], t, local_freqs) for h in range(H)])
            lk.append([apply_rope(k[h], t, local_freqs) for h in range(H)])
            lv.append([v[h] for h in range(H)])
        local_out = []
        for t in range(n):
            lo = max(0, t - window + 1)
            heads = []
            for h in range(H):
                keys = [lk[j][h] for j in range(lo, t + 1)]
                vals = [lv[j][h] for j in range(lo, t + 1)]
                heads.append(attend(lq[t][h], keys, vals, 1.0 / math.sqrt(u)))
            local_out.append(Wo @ torch.cat(heads))

        # ---- router ------------------------------------------------------------------
        Wr = p["attention.sparse_attention.router.routing_weight"]
        sel_rows, P_rows = [], []
        taken = set()
        for t in range(n):
            if t % W == 0:
                taken = set()
            z = Wr @ hs[t]  # (L,)
            scores = entmax_bisect_12([float(v) for v in z])
            masked = z.clone()
            for e in taken:
                masked[e] = float("-inf")
            sel = torch.topk(masked, K).indices.tolist()
            taken.update(sel)
            chosen = [scores[e] for e in sel]
            denom = max(sum(chosen), tiny)
            sel_rows.append(sel)
            P_rows.append([c / denom for c in chosen])
        selected_all.append(sel_rows)

        # ---- BEA: one sequence per expert head ---------------------------------------
        bq = p["attention.sparse_attention.bea.q_proj"]  # (L, d, u)
        bk = p["attention.sparse_attention.bea.k_proj"]
        bv = p["attention.sparse_attention.bea.v_proj"]
        bo = p["attention.sparse_attention.bea.o_proj"]  # (L, u, d)
        # S[l] = tokens that selected l, in token order
        S = [[t for t in range(n) if l in sel_rows[t]] for l in range(L)]
        y = {}  # (t, l) -> (d,)
        for l in range(L):
            keys, vals = [], []
            for idx, t in enumerate(S[l]):
                r = idx if semantic else t
                keys.append(apply_rope(hs[t] @ bk[l], r, mosrah_freqs))
                vals.append(hs[t] @ bv[l])
                q = apply_rope(hs[t] @ bq[l], r, mosrah_freqs)
                att = attend(q, keys[: idx + 1], vals[: idx + 1], A / math.sqrt(u))
                y[(t, l)] = att @ bo[l]
        mosrah_out = []
        for t in range(n):
            out = torch.zeros(d, dtype=DTYPE)
            for Pk, l in zip(P_rows[t], sel_rows[t]):
                out = out + Pk * y[(t, l)]
            mosrah_out.append(out)

        # ---- residuals and MLP -------------------------------------------------------
        a = [xs[t] + g_attn * (local_out[t] + mosrah_out[t]) for t in range(n)]
        Wg = p["mlp.gate_proj.weight"]
        Wu = p["mlp.up_proj.weight"]
        Wd = p["mlp.down_proj.weight"]
        xs = []
        for t in range(n):
            m = rms_norm(a[t], p["mlp_norm.weight"], eps)
            mlp = Wd @ (torch.nn.functional.silu(Wg @ m) * (Wu @ m))
            xs.append(a[t] + g_mlp * mlp)

    logits = torch.stack([lm_head @ rms_norm(x, sd["model.norm.weight"], eps) for x in xs])
    return logits, selected_all


# ----------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------

def oracle_forward(cfg, sd, input_ids, attention_mask=None):
    """Returns (logits (B, N, V) float64, selected (num_layers, B, N, K) long).

    Dead positions: logits zero, selected -1."""
    B, N = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones(B, N, dtype=torch.bool)
    attention_mask = attention_mask.bool()
    V = cfg["vocab_size"]
    K = cfg["num_selected_heads"]
    num_layers = cfg["num_decoder_layers"]
    logits = torch.zeros(B, N, V, dtype=DTYPE)
    selected = torch.full((num_layers, B, N, K), -1, dtype=torch.long)
    for b in range(B):
        cols = [j for j in range(N) if bool(attention_mask[b, j])]
        if not cols:
            continue
        ids = [int(input_ids[b, j]) for j in cols]
        row_logits, row_sel = _row_forward(cfg, sd, ids)
        for i, j in enumerate(cols):
            logits[b, j] = row_logits[i]
            for li in range(num_layers):
                selected[li, b, j] = torch.tensor(row_sel[li][i])
    return logits, selected


def oracle_greedy(cfg, sd, input_ids, attention_mask, n):
    """Greedy continuation (B, n) of each row's live tokens, by re-running the full forward."""
    B, N = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones(B, N, dtype=torch.bool)
    out = torch.zeros(B, n, dtype=torch.long)
    for b in range(B):
        ids = [int(input_ids[b, j]) for j in range(N) if bool(attention_mask[b, j])]
        for step in range(n):
            row_logits, _ = _row_forward(cfg, sd, ids)
            nxt = int(torch.argmax(row_logits[-1]))
            out[b, step] = nxt
            ids.append(nxt)
    return out
