# SPDX-License-Identifier: Apache-2.0
"""NumPy float64 oracle for UNComp (Xiong et al., arXiv 2410.03090): truncated matrix entropy of the queries, head
groups and per-head budgets, the layer partition and hidden-state pruning, the per-head SnapKV-style prefill
selection and the one-eviction-per-step decode update.

Written from shared/specs/uncomp.md (§2 formulas, §7 resolutions, §8 properties) and the API contract of issue 12.
Nothing here imports or mirrors kvc's C++ code.

Entropy (spec §2.2-2.3, §7.1-7.4, §7.19), one head's rows X [n, D] (post-RoPE queries), in float64:
  R = X − mean over rows; normalize_rows (authors' code, default): z_j = r_j / ‖r_j‖, rows with ‖r_j‖ = 0 skipped;
  otherwise (covariance, Eq. 1) z_j = r_j. A = ZᵀZ / n; λ = eigenvalues of A / Tr(A) (descending, negatives from
  round-off clamped to 0, then divided by their sum), then + ridge each (Â = A/Tr A + ridge·I; 0 by default);
  k = min(top_k, n, D); H_k = −Σ_{i<k} λ_i ln λ_i (0 ln 0 = 0; renormalize_topk: the top k divided by their sum
  first); H = the same over the whole spectrum; erank_k = exp(H_k); normalized = H_k / ln D.
  Every centred row zero (n = 1, constant rows): H_k = H = 0, erank_k = 1, normalized 0.

Groups (spec §2.5, §7.5, §7.16): balanced_group_sizes(H, M): sizes ⌊H/M⌋, the H mod M leftover heads to the
outer pairs of groups (symmetric; the authors' 11/10/11 and 7/6/6/6/7; see the function for the odd one).
group_heads: heads sorted by entropy descending (ties: lower head index first), cut into contiguous bins of those
sizes; group 0 = highest entropy. majority_vote_groups: for label v = 0..M−1 in turn, the sizes[v] still-unassigned
heads with the most votes for v (ties: lower head index). reduce_to_kv_heads: mean over each KV head's query heads
(query head h belongs to KV head h // (H / Hkv)).

Budgets (spec §2.6, §7.6): preserving: N_g = B̄ + (c − g)·Δ, g = 1..M, c = Σ_g n_g g / H; each head gets its
group's N_g (a real number); largest-remainder rounding in exact rational arithmetic (fractions.Fraction of the
given doubles) to the layer total round(H·B̄) (half away from zero): floors, then +1 to the heads with the largest
fractional remainder (ties: the lower group, i.e. higher entropy, then the lower head index); then clamped to
>= min_tokens (w) (negative real budgets too).

Layers (spec §2.9, §7.9-7.14): partition_layers: a drop s_{l−1} − s_l > ε starts a new stage at l;
partition_layers_count: the (stages − 1) largest drops (ties: lower layer) start stages; hidden_state_counts:
K_0 = n, K_c = max(min_tokens, n − c·step) (never above n), step <= 0 → ⌊(n − min_tokens)/(stages − 1)⌋, all n when
n <= min_tokens; select_hidden_states: top `keep` of u (ties: lower index) ∪ the last `window` rows, ascending.

Prefill selection (spec §2.7, §7.15, §7.17, GQA per KV head): P = causal softmax (scale 1/sqrt(d)) of the w window
queries (row r at position N − w + r) over the N keys, per query head; A[j, r] = Σ over the KV head's query heads of
P[r, j]; s[j] = Σ_r A[j, r] for the prefix j ∈ [0, N − w); ŝ = max-pool (kernel 7, stride 1, −inf padding, i.e.
over the prefix values that exist); b = min(N, budget); keep = top-(b − w) of ŝ (ties: lower index) ∪ [N − w, N),
ascending (b <= w: the last b only).

Decode (spec §2.8, §7.18, cache kept in position order): after the prefill, the cache holds `keep` and the stored
rows A = A_full[keep] (n × w, oldest window row first). Each step: append the new key (position N + t) -> n + 1
slots; p[j] = Σ over the group's query heads of softmax(q_new · K_cacheᵀ / sqrt(d)) (the new key included);
A' = the stored rows plus a row for the new slot (0 for every earlier query), then p appended as the newest query
column, keeping the last w columns (spec's [[A, 0]; [p]] transposed: slot-major); if n + 1 > budget:
s[j] = Σ_r A'[j, r] over the prefix j ∈ [0, n + 1 − w), max-pool 7 over the prefix, evict the single lowest slot
(ties: the higher index, so that the kept set is the top-k with ties to the lower index); rows of the survivors move with them. A head at or under its budget evicts nothing.

Vector format (written by make_vectors.py into the vectors folder, listed in uncomp_manifest.txt; folders uncomp_<...>):
  <case>/meta.txt      lines "key value": window_size W, kernel_size 7, prefill_length N, decode_steps T,
                       groups_q Mq, groups_kv Mkv, average B̄ (repr), step Δ (repr), theta 10000 (informational:
                       the arrays are already post-RoPE). Budgets' min_tokens = W.
  <case>/keys.npy      float32 [B, Hkv, N + T, d]: POST-RoPE keys, key j at position j; [0, N) the prompt, N + t the
                       key appended at decode step t.
  <case>/queries.npy   float32 [B, Hq, N + T, d]: POST-RoPE queries, row i at position i; rows [N − W, N) are the
                       prefill window, row N + t the decode query of step t. (No values: they do not affect any
                       kept set; a test may use any, e.g. the keys.)
  <case>/entropy.txt   one line per entropy variant: "<name> <rows> <top_k> <normalize_rows 0|1>
                       <renormalize_topk 0|1> <ridge repr>"; the variant reads query rows [0, rows) of each (b, hq).
  <case>/entropy_<name>.npy   float64 [B, Hq, 4]: (H_k, H, erank_k, normalized = H_k / ln d) per (b, query head).
  Calibration: the B sequences are the samples; the entropy is variant "authors" (rows N, top_k max(1, d/4),
  normalize_rows 1, renormalize_topk 0, ridge 0).
  <case>/erank_q.npy          float64 [Hq]: mean over b of erank_k (EntropyCalibration::mean_erank).
  <case>/normalized_q.npy     float64 [Hq]: mean over b of H_k / ln d (mean_normalized).
  <case>/group_sizes_q.npy    int64 [Mq]: balanced_group_sizes(Hq, Mq) (first Hq mod Mq groups one larger).
  <case>/groups_q.npy         int64 [Hq]: group_heads(erank_q, Hq, Mq) (0 = highest entropy).
  <case>/labels_q.npy         int64 [B, Hq]: group_heads of each sample's erank_k (the per-sample vote labels).
  <case>/groups_q_vote.npy    int64 [Hq]: majority_vote_groups(labels_q, B, Hq, Mq).
  <case>/budgets_q.npy        int64 [Hq]: head_budgets(preserving B̄, Mq, Δ; groups_q; min_tokens W).
  <case>/erank_kv.npy         float64 [Hkv]: reduce_to_kv_heads(erank_q) (mean over each KV head's query heads).
  <case>/group_sizes_kv.npy   int64 [Mkv];  groups_kv.npy int64 [Hkv]: group_heads(erank_kv, Hkv, Mkv).
  <case>/budgets_kv.npy       int64 [Hkv]: head_budgets(preserving B̄, Mkv, Δ; groups_kv; min_tokens W): the
                              per-KV-head budgets of the prefill and the decode below.
  <case>/prefill_window.npy   float64 [B, Hkv, N, W]: A_full[j, r] (group-summed window probabilities; window rows
                              oldest first; slot j of the prompt, window slots included).
  <case>/prefill_scores.npy   float64 [B, Hkv, N − W]: ŝ, the pooled prefix scores.
  <case>/prefill_kept.npy     int64 [B, Hkv, N]: kept positions (ascending) for min(N, budgets_kv[h]), padded -1.
  <case>/prefill_gap.npy      float64 [B, Hkv]: smallest relative gap between a kept and a dropped pooled score
                              of distinct value (inf: nothing dropped); a kept set may differ only where it is tiny.
  <case>/decode_evicted.npy   int64 [B, Hkv, T]: position evicted at step t (-1: no eviction, cache <= budget).
  <case>/decode_kept.npy      int64 [B, Hkv, N + T]: kept positions after the T steps (ascending), padded -1.
  <case>/decode_gap.npy       float64 [B, Hkv, T]: the same relative gap for each step's eviction (inf: none).
Budget grid (uncomp_budgets/, arithmetic only):
  params.npy    float64 [R, 5]: heads H, groups M, average B̄, step Δ, min_tokens w.
  entropy.npy   float64 [R, 32]: per-head entropies (any unit; exact ties occur), padded NaN.
  sizes.npy     int64 [R, 32]: balanced_group_sizes(H, M), padded -1.
  groups.npy    int64 [R, 32]: group_heads(entropy, H, M), padded -1.
  budgets.npy   int64 [R, 32]: head_budgets(preserving, groups, w), padded -1.
Vote grid (uncomp_vote/): entropy.npy float64 [R, S, 32] per-sample entropies (padded NaN), params.npy int64 [R, 3]
  (heads H, groups M, samples S), labels.npy int64 [R, S, 32] (group_heads per sample), vote.npy int64 [R, 32]
  (majority_vote_groups), mean.npy int64 [R, 32] (group_heads of the mean over samples); padded -1.
"""
import math
from fractions import Fraction

import numpy as np


# ------------------------------------------------------------------------------------------------- entropy
def plogp(x):
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros_like(x)
    pos = x > 0
    out[pos] = x[pos] * np.log(x[pos])
    return out


def spectrum(rows, normalize_rows=True, method="eigh"):
    """Trace-normalised eigenvalues (descending, clamped, sum 1) of A = ZᵀZ/n; empty when every centred row is zero.

    method: "eigh" (D × D second moment), "gram" (n × n Z Zᵀ / n), "svd" (σ(Z/√n)²). Zero rows are skipped."""
    x = np.asarray(rows, dtype=np.float64)
    r = x - x.mean(axis=0, keepdims=True)
    norms = np.linalg.norm(r, axis=1)
    r = r[norms > 0]
    if normalize_rows:
        r = r / np.linalg.norm(r, axis=1, keepdims=True)
    if r.shape[0] == 0:
        return np.zeros(0)
    n = x.shape[0]
    if method == "eigh":
        lam = np.linalg.eigvalsh(r.T @ r / n)
    elif method == "gram":
        lam = np.linalg.eigvalsh(r @ r.T / n)
    elif method == "svd":
        lam = np.linalg.svd(r / math.sqrt(n), compute_uv=False) ** 2
    else:
        raise ValueError(method)
    lam = np.sort(np.maximum(lam, 0.0))[::-1]
    s = lam.sum()
    if s <= 0:
        return np.zeros(0)
    return lam / s


def matrix_entropy(rows, top_k=32, normalize_rows=True, renormalize_topk=False, ridge=0.0, method="eigh"):
    """dict truncated (H_k), full (H), erank (exp H_k), normalized (H_k / ln D), k (= min(top_k, n, D))."""
    x = np.asarray(rows, dtype=np.float64)
    n, D = x.shape
    k = min(top_k, n, D)
    lam = spectrum(x, normalize_rows, method)
    if lam.size == 0:
        return {"truncated": 0.0, "full": 0.0, "erank": 1.0, "normalized": 0.0, "k": k}
    lam = lam + ridge
    top = lam[:k]
    if renormalize_topk and top.sum() > 0:
        top = top / top.sum()
    hk = float(-plogp(top).sum())
    h = float(-plogp(lam).sum())
    return {"truncated": hk, "full": h, "erank": math.exp(hk), "normalized": hk / math.log(D) if D > 1 else 0.0,
            "k": k}


def entropy_table(queries, rows, top_k, normalize_rows=True, renormalize_topk=False, ridge=0.0):
    """[B, Hq, 4] = (H_k, H, erank_k, normalized) of query rows [0, rows) of each (b, hq) of queries [B, Hq, n, d]."""
    q = np.asarray(queries, dtype=np.float64)
    B, Hq = q.shape[:2]
    out = np.zeros((B, Hq, 4))
    for b in range(B):
        for h in range(Hq):
            e = matrix_entropy(q[b, h, :rows], top_k, normalize_rows, renormalize_topk, ridge)
            out[b, h] = (e["truncated"], e["full"], e["erank"], e["normalized"])
    return out


# -------------------------------------------------------------------------------------------------- groups
def balanced_group_sizes(heads, groups, extra="symmetric"):
    """Sizes of `groups` balanced groups over `heads` (differ by at most 1, sum = heads). `extra` = "symmetric" (the
    library's rule, which gives the authors' hard-coded 11/10/11 and 7/6/6/6/7 for 32 heads): the heads mod groups
    leftover heads go to the outer pairs of groups (0, M−1), (1, M−2), ...; an odd one left goes to the middle group
    (M odd) or to group ⌊r/2⌋ (M even). "first" (numpy.array_split) and "last" are kept for comparison."""
    if not 1 <= groups <= heads:
        raise ValueError(f"groups {groups} not in [1, heads {heads}]")
    base, rem = divmod(heads, groups)
    if extra == "symmetric":
        pairs = rem // 2
        odd = (groups // 2 if groups % 2 == 1 else pairs) if rem % 2 == 1 else -1
        return [base + (1 if min(g, groups - 1 - g) < pairs or g == odd else 0) for g in range(groups)]
    sizes = [base + (1 if g < rem else 0) for g in range(groups)]
    return sizes if extra == "first" else sizes[::-1]


def group_heads(entropy, groups, extra="symmetric"):
    """group_of_head [H]: heads by entropy descending (ties: lower index first) cut into balanced contiguous bins."""
    e = [float(x) for x in entropy]
    order = sorted(range(len(e)), key=lambda h: (-e[h], h))
    sizes = balanced_group_sizes(len(e), groups, extra)
    out = [0] * len(e)
    pos = 0
    for g, size in enumerate(sizes):
        for h in order[pos: pos + size]:
            out[h] = g
        pos += size
    return out


def majority_vote_groups(labels, groups, extra="symmetric"):
    """labels [S][H] (0 = highest); for v = 0..M−1 the sizes[v] unassigned heads with the most votes for v (ties:
    lower head index)."""
    labels = [list(map(int, row)) for row in labels]
    H = len(labels[0])
    sizes = balanced_group_sizes(H, groups, extra)
    out = [-1] * H
    for v in range(groups):
        votes = {h: sum(1 for row in labels if row[h] == v) for h in range(H) if out[h] < 0}
        for h in sorted(votes, key=lambda x: (-votes[x], x))[: sizes[v]]:
            out[h] = v
    return out


def reduce_to_kv_heads(per_query_head, kv_heads):
    """Mean over each KV head's query heads (query head h -> KV head h // (H / Hkv))."""
    x = np.asarray(per_query_head, dtype=np.float64)
    if x.shape[-1] % kv_heads:
        raise ValueError("heads not a multiple of kv_heads")
    return x.reshape(x.shape[:-1] + (kv_heads, x.shape[-1] // kv_heads)).mean(axis=-1)


# ------------------------------------------------------------------------------------------------- budgets
def group_budgets(average, step, sizes):
    """Preserving closed form, exact: N_g = B̄ + (c − g) Δ, g = 1..M, c = Σ n_g g / H (Fractions)."""
    H = sum(sizes)
    c = Fraction(sum(n * (g + 1) for g, n in enumerate(sizes)), H)
    return [Fraction(average) + (c - (g + 1)) * Fraction(step) for g in range(len(sizes))]


def round_half_away(x):
    x = Fraction(x)
    return math.floor(x + Fraction(1, 2)) if x >= 0 else -math.floor(-x + Fraction(1, 2))


def head_budgets(average, groups, step, group_of_head, min_tokens, extra="symmetric"):
    """Integer per-head budgets: group budgets per head, largest remainder to round(H B̄) (ties: lower group, then lower head), then
    clamped to >= min_tokens."""
    H = len(group_of_head)
    per_group = group_budgets(average, step, balanced_group_sizes(H, groups, extra))
    real = [per_group[g] for g in group_of_head]
    floors = [math.floor(r) for r in real]
    left = round_half_away(Fraction(average) * H) - sum(floors)
    order = sorted(range(H), key=lambda h: (-(real[h] - floors[h]), group_of_head[h], h))
    for h in order[:left]:
        floors[h] += 1
    return [max(min_tokens, b) for b in floors]


def paper_budgets(largest, step, group_of_head, min_tokens):
    """The paper's schedule N_1 = largest, N_{g+1} = N_g − Δ (integers), clamped to >= min_tokens."""
    return [max(min_tokens, int(largest - g * step)) for g in group_of_head]


def list_budgets(budget_list, group_of_head, min_tokens):
    return [max(min_tokens, int(budget_list[g])) for g in group_of_head]


# -------------------------------------------------------------------------------------------------- layers
def partition_layers(layer_score, epsilon):
    """stage_of_layer: a drop s_{l−1} − s_l > ε starts a new stage at l."""
    stage, out = 0, []
    for l, s in enumerate(layer_score):
        if l > 0 and layer_score[l - 1] - s > epsilon:
            stage += 1
        out.append(stage)
    return out


def partition_layers_count(layer_score, stages):
    """The (stages − 1) largest drops s_{l−1} − s_l (ties: lower layer) start stages."""
    L = len(layer_score)
    drops = sorted(range(1, L), key=lambda l: (-(layer_score[l - 1] - layer_score[l]), l))[: stages - 1]
    starts = set(drops)
    stage, out = 0, []
    for l in range(L):
        if l in starts:
            stage += 1
        out.append(stage)
    return out


def hidden_state_counts(n, stages, min_tokens, step=0):
    """K_0 = n, K_c = max(min_tokens, n − c step) (<= n); step <= 0: ⌊(n − min_tokens)/(stages − 1)⌋."""
    if n <= min_tokens:
        return [n] * stages
    if step <= 0:
        step = (n - min_tokens) // (stages - 1) if stages > 1 else 0
    return [n] + [min(n, max(min_tokens, n - c * step)) for c in range(1, stages)]


def select_hidden_states(scores, keep, window):
    """Top `keep` of scores (ties: lower index) with the last `window` rows forced, ascending; len = min(keep, n), at
    least min(window, n)."""
    s = np.asarray(scores, dtype=np.float64)
    n = len(s)
    forced = list(range(max(0, n - window), n))
    keep = max(min(keep, n), len(forced))
    cand = np.arange(0, max(0, n - window))
    order = cand[np.lexsort((cand, -s[cand]))] if len(cand) else cand
    return sorted(forced + [int(i) for i in order[: keep - len(forced)]])


def hidden_state_scores(keys, queries, window, scale=None):
    """u [n] = Σ over ALL query heads of the last `window` rows' causal softmax (no pooling, window keys included);
    keys [Hkv, n, d], queries [Hq, n, d] (POST-RoPE, row i at position i)."""
    k = np.asarray(keys, dtype=np.float64)
    q = np.asarray(queries, dtype=np.float64)
    n = k.shape[1]
    p = window_probabilities(k[None], q[None, :, n - window:n], scale)[0]  # [Hq, w, n]
    return p.sum(axis=(0, 1))


# ------------------------------------------------------------------------------------------------ prefill
def window_probabilities(keys, window_queries, scale=None):
    """Causal softmax P [B, Hq, w, N] of window queries (row r at position N − w + r) over keys [B, Hkv, N, d]."""
    k = np.asarray(keys, dtype=np.float64)
    q = np.asarray(window_queries, dtype=np.float64)
    B, Hkv, N, d = k.shape
    Hq, w = q.shape[1], q.shape[2]
    c = 1.0 / math.sqrt(d) if scale is None else scale
    logits = np.einsum("bhrd,bhjd->bhrj", q, np.repeat(k, Hq // Hkv, axis=1)) * c
    visible = np.arange(N)[None, :] <= (N - w + np.arange(w))[:, None]
    z = np.where(visible, logits, -np.inf)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def group_window_rows(keys, window_queries, scale=None):
    """A_full [B, Hkv, N, w]: Σ over each KV head's query heads of P[r, j], rows oldest first."""
    p = window_probabilities(keys, window_queries, scale)
    B, Hq, w, N = p.shape
    Hkv = np.shape(keys)[1]
    return p.reshape(B, Hkv, Hq // Hkv, w, N).sum(axis=2).transpose(0, 1, 3, 2)


def max_pool(x, kernel=7):
    """Max-pool, stride 1, padding kernel // 2 with −inf: each entry is the max of the values in its window."""
    x = np.asarray(x, dtype=np.float64)
    m, half = len(x), kernel // 2
    return np.array([x[max(0, j - half): min(m, j + half + 1)].max() for j in range(m)]) if m else x.copy()


def boundary_gap(values, kept_mask):
    """Smallest relative gap between a kept and a dropped value of distinct value (inf when either side is empty
    or every cross pair is an exact tie, which both sides break by index)."""
    v = np.asarray(values, dtype=np.float64)
    kept, dropped = v[kept_mask], v[~kept_mask]
    if kept.size == 0 or dropped.size == 0:
        return math.inf
    best = math.inf
    lo, hi = kept.min(), dropped.max()
    cands = [(lo, hi)]
    if lo == hi:  # an exact tie at the boundary: the nearest distinct values on either side matter
        above = kept[kept > lo]
        below = dropped[dropped < hi]
        cands = ([(above.min(), lo)] if above.size else []) + ([(hi, below.max())] if below.size else [])
    for a, b in cands:
        if a != b:
            best = min(best, abs(a - b) / max(abs(a), abs(b)))
    return best


def select_prefix(pooled, n, window, budget):
    """Kept slots (ascending) of a cache of n slots: top-(b − w) of the pooled prefix (ties: lower index) ∪ the last
    w, b = min(n, budget); and the boundary gap."""
    b = min(n, budget)
    if b <= window:
        return np.arange(n - b, n, dtype=np.int64), math.inf
    m = n - window
    cand = np.arange(m)
    order = cand[np.lexsort((cand, -pooled))]
    chosen = np.sort(order[: b - window])
    mask = np.zeros(m, dtype=bool)
    mask[chosen] = True
    return np.concatenate([chosen, np.arange(m, n)]).astype(np.int64), boundary_gap(pooled, mask)


def prefill_head(window_rows, budget, window, kernel=7):
    """One (b, KV head): window_rows A_full [N, w]. Returns (pooled prefix scores [N − w], kept, gap)."""
    A = np.asarray(window_rows, dtype=np.float64)
    N = A.shape[0]
    pooled = max_pool(A[: N - window].sum(axis=1), kernel)
    kept, gap = select_prefix(pooled, N, window, budget)
    return pooled, kept, gap


def decode_head(keys, queries, group, kept, window_rows, budget, window, steps, kernel=7, scale=None):
    """One (b, KV head) over `steps` decode steps. keys [N + T, d] (the KV head's), queries [g, N + T, d] (its query
    heads), kept: prefill kept positions, window_rows: A_full [N, w]. Returns (evicted [T], final kept, gaps [T])."""
    k = np.asarray(keys, dtype=np.float64)
    q = np.asarray(queries, dtype=np.float64)
    d = k.shape[1]
    c = 1.0 / math.sqrt(d) if scale is None else scale
    N = k.shape[0] - steps
    slots = [int(i) for i in kept]
    A = np.asarray(window_rows, dtype=np.float64)[slots]  # [n, w]
    evicted, gaps = [], []
    for t in range(steps):
        pos = N + t
        slots.append(pos)
        A = np.vstack([A, np.zeros((1, A.shape[1]))])
        logits = q[:, pos] @ k[slots].T * c  # [g, n]
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        p = (e / e.sum(axis=1, keepdims=True)).sum(axis=0)
        A = np.hstack([A, p[:, None]])[:, -window:]
        n = len(slots)
        if n <= budget:
            evicted.append(-1)
            gaps.append(math.inf)
            continue
        m = n - window
        pooled = max_pool(A[:m].sum(axis=1), kernel)
        # the complement of a top-(m − 1) whose ties keep the lower index: the lowest score, ties: the HIGHER index
        # (max pooling spreads one maximum over up to 7 neighbours, so exact ties are common)
        j = int(np.lexsort((-np.arange(m), pooled))[0])
        mask = np.ones(m, dtype=bool)
        mask[j] = False
        gaps.append(boundary_gap(pooled, mask))
        evicted.append(slots[j])
        del slots[j]
        A = np.delete(A, j, axis=0)
    return evicted, slots, gaps


def prefill(keys, queries, budgets, window, kernel=7, scale=None):
    """Every (b, KV head) of keys [B, Hkv, N, d] and window queries [B, Hq, w, d] with per-KV-head budgets [Hkv].

    Returns A_full [B, Hkv, N, w], pooled [B, Hkv, N − w], kept [[array]], gaps [B, Hkv]."""
    A = group_window_rows(keys, queries, scale)
    B, Hkv = A.shape[:2]
    pooled = np.zeros((B, Hkv, A.shape[2] - window))
    kept = [[None] * Hkv for _ in range(B)]
    gaps = np.zeros((B, Hkv))
    for b in range(B):
        for h in range(Hkv):
            pooled[b, h], kept[b][h], gaps[b, h] = prefill_head(A[b, h], budgets[h], window, kernel)
    return A, pooled, kept, gaps
