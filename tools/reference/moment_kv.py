# SPDX-License-Identifier: Apache-2.0
"""NumPy float64 oracle for MomentKV (arXiv 2606.01563): the moments of the evicted set, the moment-informed (MI)
eviction score, the normalisation-corrected (NC) attention, and the prefill protocol in rounds.

Written from shared/specs/moment_kv.md (§2 formulas, §4 prefill protocol, §9 resolutions) and kvc's resolved
choices in docs/policies/moment_kv.md. Independent of kvc's C++ code.

Shapes and conventions:
  keys      [B, Hkv, N, dk]  POST-RoPE, key j at absolute position j (as the cache stores them, spec §9.8).
  values    [B, Hkv, N, dv]  dv may differ from dk.
  queries   [B, Hq, w, dk]   POST-RoPE window queries, row i at position N - w + i (the base score).
  GQA       query head h reads KV head h // (Hq // Hkv); the moments are per (sequence, KV head).
  c         the logit scale, 1/sqrt(dk) unless given (spec §9.7).
Moments (one head) are a dict in Welford form (spec §2.3): n (int), km = k̄ [dk], vm = v̄ [dv],
C = Σ (v_i − v̄)(k_i − k̄)ᵀ [dv, dk] (= the paper's S̃); n = 0 has km = vm = 0 and C = 0.

Base score α (SnapKV window attention, the authors' variant, spec §4 / §9.2-9.4): per query head, the SUM over the
w window rows of their causal softmax probabilities over the N slots; the MEAN over the GQA group; then pooling of
the prefix (the m = N − w slots before the first window query) by aligned chunks of kernel_size slots (each slot
gets its chunk's mean, a last partial chunk averages its own slots); window slots get max(pooled prefix) + 1 (1 for
an empty prefix).

MI score (spec §2.7, §9.9): r_j = v_j − v̄ − (c/n) C̃ k_j (n = 0: r_j = v_j), C̃ = C with entries |x| < tau zeroed;
score_j = α_j ‖r_j‖ (higher = keep); an α of 0 or +inf stays as is.

Prefill (spec §9.1, kvc's resolution): α frozen; L_h = what a uniform FixedBudget top-k keeps on α:
min(n, max(budget, protected)), protected = the first n_sink and the last n_recent slots; then for rounds_left =
R..1: a head with n > L_h keeps n − ceil((n − L_h)/rounds_left) by top-k of the MI scores under the current moments
(ties to the lower index, protected always kept); the evicted rows join the moments (Chan's merge of their block).

Corrected attention (spec §2.4-2.6): per query row, with (o_R, lse_R) the causal softmax attention over the retained
slots: lse_E = log n + c qᵀk̄, f̂_E = v̄ + (c/n) C̃ q (order "zeroth": v̄), lse = logaddexp(lse_R, lse_E),
out = e^{lse_R − lse} o_R + e^{lse_E − lse} f̂_E; n = 0 returns (o_R, lse_R) unchanged.
"""
import math

import numpy as np

DEFAULT_TAU = 1e-6


# ------------------------------------------------------------------------------------------------- moments
def empty_moments(dk, dv):
    return {"n": 0, "km": np.zeros(dk), "vm": np.zeros(dv), "C": np.zeros((dv, dk))}


def moments_of(keys, values):
    """Two-pass moments of a block of rows keys [m, dk], values [m, dv]: n, means, C = (V − v̄)ᵀ (K − k̄)."""
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    m = {"n": int(k.shape[0]), "km": np.zeros(k.shape[1]), "vm": np.zeros(v.shape[1]),
         "C": np.zeros((v.shape[1], k.shape[1]))}
    if m["n"]:
        m["km"] = k.mean(axis=0)
        m["vm"] = v.mean(axis=0)
        m["C"] = (v - m["vm"]).T @ (k - m["km"])
    return m


def merge(a, b):
    """Chan's merge of two sets (spec §2.3): n = n_a + n_b, means moved by n_b/n, C = C_a + C_b + (n_a n_b/n) Δv Δkᵀ."""
    if b["n"] == 0:
        return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in a.items()}
    if a["n"] == 0:
        return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in b.items()}
    n = a["n"] + b["n"]
    dk_ = b["km"] - a["km"]
    dv_ = b["vm"] - a["vm"]
    return {"n": n, "km": a["km"] + (b["n"] / n) * dk_, "vm": a["vm"] + (b["n"] / n) * dv_,
            "C": a["C"] + b["C"] + (a["n"] * b["n"] / n) * np.outer(dv_, dk_)}


def add_token(m, k, v):
    """Welford's single add (spec §2.3): n' = n+1, k̄' = k̄ + Δk/n', v̄' = v̄ + (v − v̄)/n', C' = C + (v − v̄') Δkᵀ."""
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    n = m["n"] + 1
    dk_ = k - m["km"]
    km = m["km"] + dk_ / n
    vm = m["vm"] + (v - m["vm"]) / n
    return {"n": n, "km": km, "vm": vm, "C": m["C"] + np.outer(v - vm, dk_)}


def raw_sums(m):
    """The paper's raw form (spec §2.3): n, s_k = n k̄, s_v = n v̄, S = C + n v̄ k̄ᵀ."""
    return m["n"], m["n"] * m["km"], m["n"] * m["vm"], m["C"] + m["n"] * np.outer(m["vm"], m["km"])


def clamp(C, tau=DEFAULT_TAU):
    """C̃: entries with |x| < tau read as zero (paper App. C.2); tau = 0 disables."""
    C = np.asarray(C, dtype=np.float64)
    return np.where(np.abs(C) < tau, 0.0, C)


# ---------------------------------------------------------------------------------------------- base score
def chunk_mean(x, kernel_size):
    """Aligned chunks [c k, (c+1) k) of x [..., m]: each slot gets its chunk's mean (a last partial chunk its own)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    m = x.shape[-1]
    for c0 in range(0, m, kernel_size):
        c1 = min(m, c0 + kernel_size)
        out[..., c0:c1] = x[..., c0:c1].mean(axis=-1, keepdims=True)
    return out


def window_probabilities(keys, queries, scale=None):
    """Causal softmax P [B, Hq, w, N] of the w window queries (row i at position N - w + i) over the N keys."""
    k = np.asarray(keys, dtype=np.float64)
    q = np.asarray(queries, dtype=np.float64)
    B, Hkv, N, dk = k.shape
    Hq, w = q.shape[1], q.shape[2]
    if Hq % Hkv or q.shape[-1] != dk or not 1 <= w <= N:
        raise ValueError(f"window queries {q.shape} do not fit keys {k.shape}")
    c = 1.0 / math.sqrt(dk) if scale is None else scale
    logits = np.einsum("bhid,bhjd->bhij", q, np.repeat(k, Hq // Hkv, axis=1)) * c
    visible = np.arange(N)[None, :] <= (N - w + np.arange(w))[:, None]
    z = np.where(visible, logits, -np.inf)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def base_scores(keys, queries, kernel_size=4, scale=None):
    """α [B, Hkv, N]: window sum per query head, group mean, chunk-mean pooling of the prefix, window = max + 1."""
    p = window_probabilities(keys, queries, scale)
    B, Hq, w, N = p.shape
    Hkv = np.shape(keys)[1]
    votes = p.sum(axis=2).reshape(B, Hkv, Hq // Hkv, N).mean(axis=2)  # [B, Hkv, N]
    m = N - w
    pooled = chunk_mean(votes[..., :m], kernel_size)
    top = pooled.max(axis=-1, keepdims=True) if m else np.zeros((B, Hkv, 1))
    return np.concatenate([pooled, np.repeat(top + 1.0, w, axis=-1)], axis=-1)


# ------------------------------------------------------------------------------------------------ MI score
def residuals(keys, values, m, scale, tau=DEFAULT_TAU):
    """r_j [n, dv] = v_j − v̄ − (c/n) C̃ k_j for rows keys [n, dk], values [n, dv]; n_e = 0: r_j = v_j."""
    v = np.asarray(values, dtype=np.float64)
    if m["n"] == 0:
        return v.copy()
    k = np.asarray(keys, dtype=np.float64)
    return v - m["vm"] - (scale / m["n"]) * (k @ clamp(m["C"], tau).T)


def mi_scores(alpha, keys, values, m, scale, tau=DEFAULT_TAU):
    """α_j ‖r_j‖ per row (higher = keep); α = 0 or +inf stays as is (no 0·inf)."""
    a = np.asarray(alpha, dtype=np.float64)
    r = np.linalg.norm(residuals(keys, values, m, scale, tau), axis=-1)
    with np.errstate(invalid="ignore"):
        s = a * r
    return np.where((a == 0) | np.isinf(a), a, s)


# -------------------------------------------------------------------------------------------------- selection
def protected_slots(n, n_sink, n_recent):
    """Indices of the first n_sink and the last n_recent of n slots (ascending, no duplicates)."""
    sink_end = min(n_sink, n)
    recent_begin = max(n - n_recent, sink_end)
    return np.concatenate([np.arange(sink_end), np.arange(recent_begin, n)]).astype(np.int64)


def fixed_budget(n, budget, n_sink, n_recent):
    """L_h of a uniform FixedBudget top-k: min(n, max(budget, protected))."""
    return min(n, max(budget, len(protected_slots(n, n_sink, n_recent))))


def top_k(scores, keep, n_sink, n_recent):
    """Kept local indices (ascending) and the boundary gap: protected slots, then the best candidates by (score
    desc, index asc). gap = relative difference between the last kept and the first dropped candidate (inf if
    nothing is dropped or kept among the candidates)."""
    s = np.asarray(scores, dtype=np.float64)
    n = len(s)
    prot = protected_slots(n, n_sink, n_recent)
    cand = np.setdiff1d(np.arange(n), prot)
    take = max(0, min(keep, n) - len(prot))
    order = cand[np.lexsort((cand, -s[cand]))]
    kept = np.sort(np.concatenate([prot, order[:take]])).astype(np.int64)
    gap = np.inf
    if 0 < take < len(order):
        a, b = s[order[take - 1]], s[order[take]]
        gap = abs(a - b) / max(abs(a), abs(b)) if max(abs(a), abs(b)) > 0 else 0.0
    return kept, gap


def round_keep(n, target, rounds_left):
    """Slots a head keeps in a round: n − ceil((n − L_h) / rounds_left) when n > L_h, else n."""
    return n if n <= target else n - (n - target + rounds_left - 1) // rounds_left


# ------------------------------------------------------------------------------------------------- prefill
def prefill_head(alpha, keys, values, budget, n_sink, n_recent, rounds, scale, tau=DEFAULT_TAU):
    """One (sequence, KV head): the prefill rounds over frozen α [N], keys [N, dk], values [N, dv].

    Returns dict: kept (original indices, ascending), moments, target L_h, mi_first (round 1 scores [N]),
    rounds (list of (n, keep, evicted original indices)), min_gap (smallest boundary gap over the rounds)."""
    alpha = np.asarray(alpha, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    N = len(alpha)
    target = fixed_budget(N, budget, n_sink, n_recent)
    slots = np.arange(N, dtype=np.int64)
    m = empty_moments(k.shape[1], v.shape[1])
    mi_first = None
    log = []
    min_gap = np.inf
    for left in range(rounds, 0, -1):
        s = mi_scores(alpha[slots], k[slots], v[slots], m, scale, tau)
        if mi_first is None:
            mi_first = s
        n = len(slots)
        keep = round_keep(n, target, left)
        if keep == n:
            log.append((n, keep, np.zeros(0, dtype=np.int64)))
            continue
        local, gap = top_k(s, keep, n_sink, n_recent)
        min_gap = min(min_gap, gap)
        evicted = np.setdiff1d(np.arange(n), local)
        m = merge(m, moments_of(k[slots[evicted]], v[slots[evicted]]))
        log.append((n, keep, slots[evicted]))
        slots = slots[local]
    return {"kept": slots, "moments": m, "target": target, "mi_first": mi_first, "rounds": log, "min_gap": min_gap}


def prefill(keys, values, queries, budget, n_sink, n_recent, rounds, kernel_size=4, scale=None, tau=DEFAULT_TAU,
            alpha=None):
    """MomentKV prefill of every (b, KV head). Returns (α [B, Hkv, N], [[prefill_head result]] per b, h)."""
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    c = 1.0 / math.sqrt(k.shape[-1]) if scale is None else scale
    if alpha is None:
        alpha = base_scores(k, queries, kernel_size, c)
    res = [[prefill_head(alpha[b, h], k[b, h], v[b, h], budget, n_sink, n_recent, rounds, c, tau)
            for h in range(k.shape[1])] for b in range(k.shape[0])]
    return alpha, res


# ------------------------------------------------------------------------------------------ corrected attention
def retained_attention(q, q_pos, keys, values, key_pos, scale):
    """Causal softmax attention of one query q [dk] at q_pos over rows keys [n, dk] (positions key_pos):
    (o_R [dv], lse_R); a query that sees nothing gets zeros and -inf."""
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    vis = np.asarray(key_pos) <= q_pos
    if not vis.any():
        return np.zeros(v.shape[1]), -np.inf
    s = scale * (k[vis] @ np.asarray(q, dtype=np.float64))
    top = s.max()
    e = np.exp(s - top)
    return e @ v[vis] / e.sum(), top + math.log(e.sum())


def evicted_state(q, m, scale, tau=DEFAULT_TAU, order="first"):
    """The evicted set as one virtual token: (f̂_E [dv], lse_E) for query q [dk]; None when n = 0."""
    if m["n"] == 0:
        return None
    q = np.asarray(q, dtype=np.float64)
    lse_e = math.log(m["n"]) + scale * float(q @ m["km"])
    est = m["vm"].copy()
    if order == "first":
        est = est + (scale / m["n"]) * (clamp(m["C"], tau) @ q)
    elif order != "zeroth":
        raise ValueError(f"unknown order {order!r}")
    return est, lse_e


def merge_states(o_r, lse_r, est, lse_e):
    """(o_R, lse_R) ⊕ (f̂_E, lse_E) in the log domain: lse = logaddexp, weights e^{lse_x − lse}."""
    lse = np.logaddexp(lse_r, lse_e)
    w_r = 0.0 if lse_r == -np.inf else math.exp(lse_r - lse)
    w_e = 0.0 if lse_e == -np.inf else math.exp(lse_e - lse)
    return w_r * np.asarray(o_r) + w_e * np.asarray(est), float(lse)


def corrected_row(q, q_pos, keys, values, key_pos, m, scale, tau=DEFAULT_TAU, order="first"):
    """Corrected attention of one query row: (out, lse, o_R, lse_R)."""
    o_r, lse_r = retained_attention(q, q_pos, keys, values, key_pos, scale)
    ev = evicted_state(q, m, scale, tau, order)
    if ev is None:
        return o_r, lse_r, o_r, lse_r
    out, lse = merge_states(o_r, lse_r, *ev)
    return out, lse, o_r, lse_r


def corrected_attention(queries, q_positions, keys, values, kept, moments, scale=None, tau=DEFAULT_TAU,
                        order="first"):
    """Corrected and plain attention of queries [B, Hq, nq, dk] (positions [B, nq]) over the kept slots
    (kept[b][h]: original indices = positions) of keys [B, Hkv, N, dk] / values, with moments[b][h].

    Returns out [B, Hq, nq, dv], lse [B, Hq, nq], plain out, plain lse."""
    q = np.asarray(queries, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    B, Hq, nq, dk = q.shape
    Hkv, dv = k.shape[1], v.shape[-1]
    c = 1.0 / math.sqrt(dk) if scale is None else scale
    g = Hq // Hkv
    out = np.zeros((B, Hq, nq, dv))
    lse = np.zeros((B, Hq, nq))
    plain = np.zeros((B, Hq, nq, dv))
    plain_lse = np.zeros((B, Hq, nq))
    for b in range(B):
        for hq in range(Hq):
            h = hq // g
            idx = np.asarray(kept[b][h], dtype=np.int64)
            for i in range(nq):
                o, l, o_r, l_r = corrected_row(q[b, hq, i], q_positions[b][i], k[b, h, idx], v[b, h, idx], idx,
                                               moments[b][h], c, tau, order)
                out[b, hq, i], lse[b, hq, i], plain[b, hq, i], plain_lse[b, hq, i] = o, l, o_r, l_r
    return out, lse, plain, plain_lse
