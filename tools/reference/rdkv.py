# SPDX-License-Identifier: Apache-2.0
"""RDKV float64 NumPy oracle (shared/specs/rdkv.md, issue 13): an independent restatement of the token and channel
weights, the bit allocators (the authors' Lagrangian bisection, the exact greedy over hull increments, an MCKP DP,
brute force), the per-head V then K budget arithmetic, the two min-max quantizers, the packed order and the
attention over the dequantised kept tokens. Everything is per (sequence, KV head); inputs are float64 copies of
what kvc sees (float32 weights are rounded by the caller where kvc takes float).

Conventions (the C++ contract, /work/rdkv_api.md):
  bits come from OPTIONS = (0, 2, 4, 8, 16); a table eps[5] holds the normalised MSE of each option.
  token weights (attn_linear): s_t = sum_{g, tau} a_{g, tau, t} / n_t over the last W window queries (causal by
    positions, softmax scale 1/sqrt(d)), n_t = window queries whose position >= position(t); then AvgPool1d with
    kernel k' = min(k, 2n - 1), stride 1, reflect padding k' // 2 (torch's F.pad(mode="reflect")).
  channel weights (ThinK): mean_{g, tau}(q_c^2) * mean_t(k_c^2) over the head's n valid tokens.
  lagrangian: knapsack_solver.py's bisection, ties to fewer bits, options off the lower convex hull never chosen.
  exact: increments between consecutive hull options of each unit, sorted by slope w (eps_i - eps_j) / (b_j - b_i)
    descending (ties: lower unit, then lower option); an increment that does not fit is skipped and blocks its
    unit's later increments; scanning goes on (fills the slack). Increments of slope 0 (w = 0) are never taken
    (they lower nothing: P2's maximality is about upgrades that lower the distortion).
  allocation per head: V budget (1 - rho) * 2 * B * dim * 16 / dim bits over the n tokens (exact: floored),
    T_eff = tokens with bits > 0, K budget rho * 2 * B * dim * 16 / max(1, T_eff) bits over the dim channels;
    an average >= 16 gives every unit 16 (P7); a head with T_eff = 0 stores no K (k_bits 0). B = budget_tokens, or
    floor(n (1 - ratio)) when ratio >= 0. The Lagrangian's b(lambda) is an argmin of w eps(b) + lambda b (kvc
    compares w * slope > lambda instead): equal except at an exact tie, which a bisection that never converges ends
    on (its last lambda is a unit's threshold), so such a head may differ from kvc in that one unit.
  quantizers (params rounded to float16 before the codes are computed; codes round half to even):
    float_min: offset = fp16(min), scale = fp16((max - min) / (2^b - 1)); code = rint(clip((x - offset) / scale,
      0, 2^b - 1)) (scale 0: code 0); x^ = code * scale + offset.
    integer: s = max((max - min) / (2^b - 1), 1e-8), zp = rint(clip(-min / s, 0, 2^b - 1)), scale = fp16(s);
      code = rint(clip(x / scale + zp, 0, 2^b - 1)); x^ = (code - zp) * scale.
  packed order: kept tokens (v bits > 0) stable-sorted by V bits 2 | 4 | 8 | 16; K params per channel over token
    groups of the packed order (G = 0: all kept tokens); V params per token over groups of v_group channels
    (0: all). V at 16 bits: fp16(v). K at 16 bits: fp16(k), or 8 bits when clamp_k16_to_8 (reference = authors).
    K channels at 0 bits are pruned (K^ column 0).
"""
import itertools
import math

import numpy as np

OPTIONS = (0, 2, 4, 8, 16)
EPS = {
    "default_v": (1.0, 0.312, 0.0138, 4.8e-5, 0.0),
    "default_k": (1.0, 0.277, 0.011, 6.1e-5, 0.0),
    "llama31_v": (1.0, 0.31287, 0.013986, 4.8554e-5, 0.0),
    "llama31_k": (1.0, 0.14894, 0.0062426, 2.1757e-5, 0.0),
}


# ---------------------------------------------------------------------------------------------- weights
def reflect_avg_pool(s, kernel):
    """AvgPool1d(kernel k' = min(kernel, 2n - 1), stride 1) over s padded by k' // 2 on each side with reflection
    (x[-i] = x[i], x[n - 1 + i] = x[n - 1 - i]): same length as s."""
    s = np.asarray(s, dtype=np.float64)
    n = s.size
    if n == 0:
        return s.copy()
    k = min(int(kernel), 2 * n - 1)
    r = k // 2
    idx = np.arange(-r, n + r)
    idx = np.where(idx < 0, -idx, idx)
    idx = np.where(idx > n - 1, 2 * (n - 1) - idx, idx)
    p = s[idx]
    return np.array([p[t:t + k].mean() for t in range(n)]) if k % 2 == 1 else \
        np.array([p[t:t + k].mean() for t in range(p.size - k + 1)])


def window_attention(keys, queries, key_pos, q_pos):
    """a[g, tau, t]: causal softmax (scale 1/sqrt(d)) of window query tau of group head g over the head's keys;
    keys [n, d], queries [g, W, d], positions [n] and [W]. Rows that see no key are 0."""
    d = keys.shape[1]
    logits = np.einsum("gwd,nd->gwn", queries, keys) / math.sqrt(d)
    mask = key_pos[None, None, :] <= q_pos[None, :, None]
    logits = np.where(mask, logits, -np.inf)
    peak = logits.max(axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    e = np.where(mask, np.exp(logits - peak), 0.0)
    tot = e.sum(axis=-1, keepdims=True)
    return np.divide(e, tot, out=np.zeros_like(e), where=tot > 0)


def token_weights(keys, queries, key_pos, q_pos, window, kernel):
    """attn_linear weights [n] of one head: keys [n, d], queries [g, >= W, d] (the last `window` rows are used)."""
    q = queries[:, -window:]
    qp = np.asarray(q_pos)[-window:]
    a = window_attention(keys, q, np.asarray(key_pos), qp)
    n_t = (np.asarray(key_pos)[:, None] <= qp[None, :]).sum(axis=1).astype(np.float64)
    s = a.sum(axis=(0, 1)) / np.maximum(n_t, 1.0)  # n_t = 0 (a token after every query): its sum is 0 anyway
    return reflect_avg_pool(s, kernel)


def channel_weights(keys, queries, window):
    """ThinK weights [d]: mean over the group and the last `window` rows of q_c^2, times mean over tokens of k_c^2."""
    q = queries[:, -window:]
    return (q ** 2).mean(axis=(0, 1)) * (keys ** 2).mean(axis=0)


# ------------------------------------------------------------------------------------------- allocators
def hull(eps, evict=True):
    """Indices (into OPTIONS) of the lower convex hull of (b, eps(b)) over the allowed options, ascending in b."""
    allowed = [i for i in range(5) if evict or i > 0]
    h = []
    for i in allowed:
        while len(h) >= 2:
            a, b = h[-2], h[-1]
            # b is on or above the segment a -> i: drop it (collinear points are dropped too: no strict minimiser)
            cross = (OPTIONS[b] - OPTIONS[a]) * (eps[i] - eps[a]) - (eps[b] - eps[a]) * (OPTIONS[i] - OPTIONS[a])
            if cross <= 0:
                h.pop()
            else:
                break
        h.append(i)
    return h


def bits_at_lambda(w, eps, lam, evict=True):
    """b_u(lambda) = argmin over hull options of w_u eps(b) + lambda b; ties to fewer bits."""
    w = np.asarray(w, dtype=np.float64)
    h = hull(eps, evict)
    e = np.array([eps[i] for i in h])
    b = np.array([OPTIONS[i] for i in h], dtype=np.float64)
    cost = w[:, None] * e[None, :] + lam * b[None, :]
    return b[np.argmin(cost, axis=1)].astype(np.int64)


def lambda_gap(w, eps, lam, evict=True):
    """Smallest distance of lambda to a decision threshold of any unit, as a fraction of (max w x the step's
    |delta eps| / delta b): how far the weights may move (relative to their max) before a decision flips."""
    w = np.asarray(w, dtype=np.float64)
    h = hull(eps, evict)
    top = max(float(w.max()), 1e-300) if w.size else 1.0
    gap = np.inf
    for i, j in zip(h[:-1], h[1:]):
        c = (eps[i] - eps[j]) / (OPTIONS[j] - OPTIONS[i])
        gap = min(gap, float(np.min(np.abs(w * c - lam))) / (top * c))
    return gap


def lagrangian_bits(w, eps, target_avg, evict=True, tol=0.01, max_iter=64, max_doublings=40, info=None):
    """The authors' bisection (knapsack_solver.py). Returns bits [n]; `info` (a dict) gets lambda, whether it
    converged, iterations, and `gap`: the smallest lambda_gap over every lambda whose decision was used, and the
    smallest distance of a convergence test |avg - target| / target to tol (relative)."""
    w = np.asarray(w, dtype=np.float64)
    n = w.size
    info = {} if info is None else info
    info.update(lam=0.0, converged=True, iters=0, gap=np.inf, tol_gap=np.inf)
    if n == 0:
        return np.zeros(0, dtype=np.int64)

    def avg(bits):
        return float(bits.sum()) / n

    def used(lam):
        info["gap"] = min(info["gap"], lambda_gap(w, eps, lam, evict)) if lam > 0 else info["gap"]

    lo, hi = 0.0, float(w.max()) * 0.375
    for _ in range(max_doublings):
        used(hi)
        if avg(bits_at_lambda(w, eps, hi, evict)) <= target_avg:
            break
        hi *= 2.0
        if hi >= 1e12:
            break
    b0 = bits_at_lambda(w, eps, 0.0, evict)
    if avg(b0) <= target_avg:
        return b0
    mid_bits = b0
    for it in range(max_iter):
        mid = (lo + hi) / 2.0
        mid_bits = bits_at_lambda(w, eps, mid, evict)
        used(mid)
        a = avg(mid_bits)
        rel = abs(a - target_avg) / max(target_avg, 1e-8)
        info["tol_gap"] = min(info["tol_gap"], abs(rel - tol) / tol)
        info.update(lam=mid, iters=it + 1)
        if rel < tol:
            return mid_bits
        if a > target_avg:
            lo = mid
        else:
            hi = mid
    info["converged"] = False
    return mid_bits


def increments(w, eps, evict=True):
    """Hull increments (slope, unit, step, from_bits, to_bits, delta_bits) in the exact solver's order."""
    h = hull(eps, evict)
    out = []
    for u, wu in enumerate(np.asarray(w, dtype=np.float64)):
        for s, (i, j) in enumerate(zip(h[:-1], h[1:])):
            db = OPTIONS[j] - OPTIONS[i]
            out.append((wu * (eps[i] - eps[j]) / db, u, s, OPTIONS[i], OPTIONS[j], db))
    out.sort(key=lambda x: (-x[0], x[1], x[2]))
    return out


def exact_bits(w, eps, budget_bits, evict=True, info=None):
    """Greedy over hull increments with skip-and-block, then the scan goes on. Σ bits <= budget_bits (P1).
    `info` gets `gap`: the smallest relative gap between consecutive slopes of different units (max w scale)."""
    w = np.asarray(w, dtype=np.float64)
    n = w.size
    h = hull(eps, evict)
    base = OPTIONS[h[0]]
    bits = np.full(n, base, dtype=np.int64)
    left = int(budget_bits) - base * n
    inc = increments(w, eps, evict)
    if info is not None:
        top = max(float(w.max()), 1e-300) if n else 1.0
        gap = np.inf
        for a, b in zip(inc[:-1], inc[1:]):
            if a[1] != b[1] and a[0] > 0:
                gap = min(gap, (a[0] - b[0]) / top)
        info["gap"] = gap
    blocked = np.zeros(n, dtype=bool)
    for slope, u, _, b_from, b_to, db in inc:
        if slope <= 0 or blocked[u]:
            continue
        assert bits[u] == b_from
        if db <= left:
            bits[u] = b_to
            left -= db
        else:
            blocked[u] = True
    return bits


def distortion(w, eps, bits):
    e = {b: eps[i] for i, b in enumerate(OPTIONS)}
    return float(sum(float(wu) * e[int(b)] for wu, b in zip(w, bits)))


def dp_bits(w, eps, budget_bits, evict=True):
    """MCKP DP (every allowed option, not only the hull): the minimum distortion with Σ bits <= budget. Costs are
    in units of 2 bits. Returns (bits, distortion); ties: the first optimum in (unit, option) order."""
    w = np.asarray(w, dtype=np.float64)
    n = w.size
    cap = max(int(budget_bits), -1) // 2
    allowed = [i for i in range(5) if evict or i > 0]
    INF = np.inf
    best = np.full((n + 1, cap + 1), INF)
    best[0, :] = 0.0  # best[u, c]: min distortion of units < u with at most c units of cost
    choice = np.zeros((n + 1, cap + 1), dtype=np.int64)
    for u in range(n):
        for c in range(cap + 1):
            for i in allowed:
                cc = OPTIONS[i] // 2
                if cc <= c and best[u, c - cc] + w[u] * eps[i] < best[u + 1, c]:
                    best[u + 1, c] = best[u, c - cc] + w[u] * eps[i]
                    choice[u + 1, c] = i
    if cap < 0 or not np.isfinite(best[n, cap]):
        raise ValueError("dp_bits: infeasible budget")
    bits = np.zeros(n, dtype=np.int64)
    c = cap
    for u in range(n, 0, -1):
        i = choice[u, c]
        bits[u - 1] = OPTIONS[i]
        c -= OPTIONS[i] // 2
    return bits, float(best[n, cap])


def brute_force(w, eps, budget_bits, evict=True):
    """Minimum distortion over every allocation with Σ bits <= budget (n <= 6)."""
    allowed = [b for b in OPTIONS if evict or b > 0]
    best, arg = np.inf, None
    for combo in itertools.product(allowed, repeat=len(w)):
        if sum(combo) <= budget_bits:
            d = distortion(w, eps, combo)
            if d < best:
                best, arg = d, combo
    return (np.array(arg, dtype=np.int64) if arg is not None else None), best


def hull_lower_bound(w, eps, budget_bits, evict=True):
    """Continuous relaxation over the hull (fractional MCKP): ΔD of the greedy with one fractional increment."""
    w = np.asarray(w, dtype=np.float64)
    h = hull(eps, evict)
    left = float(budget_bits) - OPTIONS[h[0]] * w.size
    d = float((w * eps[h[0]]).sum())
    for slope, _, _, _, _, db in increments(w, eps, evict):
        if left <= 0 or slope <= 0:
            break
        take = min(1.0, left / db)
        d -= take * slope * db
        left -= take * db
    return d


# ---------------------------------------------------------------------------------------------- RDKV plan
def head_budget_tokens(n, budget_tokens, ratio):
    return int(math.floor(n * (1.0 - ratio))) if ratio >= 0 else int(budget_tokens)


def allocate_head(tw, cw, B, rho, solver, eps_v, eps_k, evict=True, lag=None, info=None):
    """One (sequence, KV head): token weights tw [n], channel weights cw [dim] (float64 values of what the solver
    sees). Returns (v_bits [n], k_bits [dim]); `info` gets the budgets and the decision gaps."""
    dim = len(cw)
    lag = lag or {}
    info = {} if info is None else info
    total = 2.0 * B * dim * 16.0
    v_budget = (1.0 - rho) * total / dim

    def solve(w, eps, budget):
        units = len(w)
        if units == 0:
            return np.zeros(0, dtype=np.int64), np.inf
        if budget / units >= 16.0:
            return np.full(units, 16, dtype=np.int64), np.inf
        sub = {}
        if solver == "exact":
            bits = exact_bits(w, eps, int(math.floor(budget)), evict, sub)
            return bits, sub["gap"]
        if solver == "lagrangian":
            bits = lagrangian_bits(w, eps, budget / units, evict, info=sub, **lag)
            return bits, min(sub["gap"], sub["tol_gap"])
        bits, _ = dp_bits(w, eps, int(math.floor(budget)), evict)
        return bits, np.inf

    v, gv = solve(tw, eps_v, v_budget)
    t_eff = int((v > 0).sum())
    k_budget = rho * total / max(1, t_eff)
    k, gk = solve(cw, eps_k, k_budget) if t_eff > 0 else (np.zeros(dim, dtype=np.int64), np.inf)  # no K stored
    info.update(v_budget=v_budget, k_budget=k_budget, t_eff=t_eff, v_gap=gv, k_gap=gk)
    return v, k


# ---------------------------------------------------------------------------------------------- quantizers
def f16(x):
    return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


def quantize_group(x, bits, zero_point):
    """Dequantised values of one group x (float32 data, as float64), and the code margins: the distance of each
    pre-rounding code to the nearest rounding boundary (half-integer), in code units (a code may flip in another
    arithmetic only where it is tiny). The parameter and code arithmetic is IEEE float32, as kvc declares it
    (quant/minmax.hpp: params from float min, max and (max - min) / (2^b - 1), rounded to half; one float division
    per code; round half to even); the float64 restatement below (quantize_group64) agrees except at tiny margins."""
    f32 = np.float32
    x = np.asarray(x, dtype=np.float64).astype(f32)
    qmax = f32((1 << bits) - 1)
    lo, hi = x.min(), x.max()
    s = f32(hi - lo) / qmax
    if zero_point == "float_min":
        scale, offset = f32(np.float16(s)), f32(np.float16(lo))
        if scale == 0:
            return np.full(x.shape, float(offset)), np.full(x.shape, np.inf)
        y = np.clip((x - offset) / scale, 0, qmax)
        code = np.rint(y)  # round half to even
        return (code * scale + offset).astype(np.float64), margin(y.astype(np.float64), float(qmax))
    si = max(s, f32(1e-8))
    scale = f32(np.float16(si))
    z = np.clip(-lo / si, 0, qmax)
    zp = np.rint(z)
    if scale == 0:
        return np.zeros(x.shape), np.full(x.shape, np.inf)
    y = np.clip(x / scale + zp, 0, qmax)
    code = np.rint(y)
    m = np.minimum(margin(y.astype(np.float64), float(qmax)), float(margin(np.array([float(z)]), float(qmax))[0]))
    return ((code - zp) * scale).astype(np.float64), m


def quantize_group64(x, bits, zero_point):
    """The same quantiser in float64 throughout (params still rounded to half): the formula without kvc's float32
    arithmetic, for the self-test's cross-check."""
    x = np.asarray(x, dtype=np.float64)
    qmax = (1 << bits) - 1
    lo, hi = float(x.min()), float(x.max())
    if zero_point == "float_min":
        offset = float(f16(lo))
        scale = float(f16((hi - lo) / qmax))
        if scale == 0.0:
            return np.full_like(x, offset)
        return np.rint(np.clip((x - offset) / scale, 0, qmax)) * scale + offset
    s = max((hi - lo) / qmax, 1e-8)
    zp = float(np.rint(np.clip(-lo / s, 0, qmax)))
    scale = float(f16(s))
    if scale == 0.0:
        return np.zeros_like(x)
    return (np.rint(np.clip(x / scale + zp, 0, qmax)) - zp) * scale


def margin(y, qmax):
    """Distance to the nearest half-integer of y, inf where the clip decided (y at 0 or qmax exactly)."""
    m = np.abs(np.abs(y - np.floor(y)) - 0.5)
    return np.where((y <= 0) | (y >= qmax), np.inf, m)


def pack_head(keys, values, positions, v_bits, k_bits, zero_point="float_min", v_group=0, k_group=0,
              clamp_k16_to_8=False):
    """One head: keys/values [n, d] (float64 copies of float32), positions [n], bits [n] and [d]. Returns
    (positions in packed order [T_eff], K^ [T_eff, d] in original channel order (pruned 0), V^ [T_eff, d], margins
    of K^ and V^ [T_eff, d])."""
    v_bits = np.asarray(v_bits)
    k_bits = np.asarray(k_bits)
    n, d = keys.shape
    order = [t for b in (2, 4, 8, 16) for t in range(n) if v_bits[t] == b]
    T = len(order)
    K = keys[order]
    V = values[order]
    khat = np.zeros((T, d))
    vhat = np.zeros((T, d))
    kmar = np.full((T, d), np.inf)
    vmar = np.full((T, d), np.inf)
    for i, t in enumerate(order):
        b = int(v_bits[t])
        if b == 16:
            vhat[i] = f16(V[i])
            continue
        g = v_group if v_group > 0 else d
        for c0 in range(0, d, g):
            vhat[i, c0:c0 + g], vmar[i, c0:c0 + g] = quantize_group(V[i, c0:c0 + g], b, zero_point)
    G = k_group if k_group > 0 else max(T, 1)
    for c in range(d):
        b = int(k_bits[c])
        if b == 0 or T == 0:
            continue
        if b == 16 and clamp_k16_to_8:
            b = 8
        if b == 16:
            khat[:, c] = f16(K[:, c])
            continue
        for t0 in range(0, T, G):
            khat[t0:t0 + G, c], kmar[t0:t0 + G, c] = quantize_group(K[t0:t0 + G, c], b, zero_point)
    return np.asarray(positions)[order], khat, vhat, kmar, vmar


def attend(q, q_pos, keys, values, key_pos):
    """Causal softmax attention of queries [g, m, d] at q_pos [m] over keys/values [T, d] at key_pos [T] (scale
    1/sqrt(d)): (out [g, m, d], lse [g, m]); a query that sees nothing gets zeros and lse = -inf."""
    d = q.shape[-1]
    logits = np.einsum("gmd,td->gmt", q, keys) / math.sqrt(d)
    mask = np.asarray(key_pos)[None, None, :] <= np.asarray(q_pos)[None, :, None]
    logits = np.where(mask, logits, -np.inf)
    peak = logits.max(axis=-1, keepdims=True) if keys.shape[0] else np.full(logits.shape[:2] + (1,), -np.inf)
    safe = np.where(np.isfinite(peak), peak, 0.0)
    e = np.where(mask, np.exp(logits - safe), 0.0)
    tot = e.sum(axis=-1, keepdims=True)
    out = np.divide(np.einsum("gmt,td->gmd", e, values), tot, out=np.zeros(q.shape), where=tot > 0)
    with np.errstate(divide="ignore"):
        lse = np.where(tot[..., 0] > 0, safe[..., 0] + np.log(np.where(tot[..., 0] > 0, tot[..., 0], 1.0)), -np.inf)
    return out, lse
