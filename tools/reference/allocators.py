# SPDX-License-Identifier: Apache-2.0
"""Independent NumPy/Python oracle for the layer-budget allocators: AdaKV (head budgets) and PyramidKV (layer budgets).

Written from shared/specs/original_baselines.md §0.4, §5 (AdaKV) and §6 (PyramidKV) and kvpress_reference.md §2.9
and §2.10, in plain Python integers and floats (no vectorised tricks, so every step can be read against the spec).
Nothing here imports or mirrors kvc's C++ code.

Scores are [B, H, N] (higher = keep), read as float64 (exact for float32 inputs); NaN ranks as -inf. Head h of
sequence b has n = lengths[b, h] valid tokens; entries at or beyond n are padding and never kept.

AdaKV conventions of the library (its documented choices where the spec leaves one open):
  * Each head's uniform share `kept` comes from a budget (FixedBudget: min(n, C); RatioBudget: int(n (1 - r))),
    protected tokens included. Protected tokens are the first n_sink and the last n_recent valid tokens (the authors'
    observation window w is n_recent); they are always kept, on top of the allocation, in both behaviours.
  * Ranking across heads is by (score descending, head ascending, index ascending): an explicit stable sort.
  * authors (§5.1): the prefix budget B_h = kept - protected; c_h = head h's winners in the global top-(sum B_h) of
    all heads' unprotected tokens; b_h = round((1 - alpha) c_h + floor(alpha B_h)), Python's round = half to even
    (§0.4), capped at the head's unprotected count; head h keeps b_h + its protected tokens. No repair of the sum.
    Short prompts (§5.1 step 2, §0.3): when every head's budget covers its whole length (kept == n, the spec's
    C >= N; the spec's C == N corner, where the authors' code still runs the mix, is not distinguishable from a
    budget clamped at n and is treated as C > N), nothing is compressed.
  * kvpress (§2.10): every head pins its top n_safe = floor(alpha kept) tokens (its protected tokens first, by
    index, as kvpress's max + 1 scores; then score descending, index ascending); the remaining sum(kept - n_safe) of
    the sequence go to the global best of the tokens that are not pinned, protected tokens ranked above every score
    (by head, then index), the others by (score desc, head, index). Head h keeps n_safe + its winners.
  * Kept sets: TopK over the per-head totals: k = min(n, max(total, protected)) tokens, every protected token and
    then the best unprotected by (score descending, index ascending); ascending indices.

PyramidKV (per-layer totals, window included):
  * authors (§6.1, integer arithmetic): B = C - w; N < C: keep N; C <= N < 2B: keep C; otherwise
    min = B // beta, max = 2B - min, clamp max to N - w (then min = 2B - max), steps = (max - min) // (L - 1),
    keep max - l * steps + w.
  * kvpress (§2.9 / §6.4, floats): cap = w + N (1 - r), min = (cap - w) / beta, max = 2 (cap - w) - min, the same
    clamp; unless N >= max >= min >= w every layer keeps round(N (1 - r)); otherwise
    round(max - l (max - min) / (L - 1)), half to even.
"""
import math


def _score(x):
    """The ranking value of one score: NaN ranks as -inf."""
    x = float(x)
    return -math.inf if math.isnan(x) else x


def protected_windows(n, n_sink, n_recent):
    """(sink_end, recent_begin) of a head of n valid tokens: [0, sink_end) and [recent_begin, n) are protected."""
    sink_end = min(n_sink, n)
    recent_begin = max(n - n_recent, sink_end)
    return sink_end, recent_begin


def fixed_keep(tokens):
    """FixedBudget: kept = min(n, tokens)."""
    return lambda n: min(n, tokens)


def ratio_keep(ratio):
    """RatioBudget (kvpress): kept = int(n (1 - ratio))."""
    return lambda n: int(n * (1.0 - ratio))


def round_half_even(x):
    """torch.round / Python 3 round (§0.4): 6.5 -> 6, 2.5 -> 2, 5.5 -> 6."""
    return int(round(x))


def ada_kv_allocate(scores, lengths, keep, alpha, reference="authors", n_sink=0, n_recent=0):
    """Per-head totals [B][H] (protected tokens included) of AdaKV over scores [B, H, N].

    keep(n) is the budget's uniform share of a head of n tokens (fixed_keep / ratio_keep).
    """
    if reference not in ("authors", "kvpress"):
        raise ValueError(f"unknown reference {reference!r}")
    B, H = len(scores), len(scores[0])
    out = []
    for b in range(B):
        heads = []
        for h in range(H):
            n = int(lengths[b][h])
            kept = max(0, min(int(keep(n)), n))
            sink_end, recent_begin = protected_windows(n, n_sink, n_recent)
            protect = sink_end + (n - recent_begin)
            heads.append(dict(n=n, kept=kept, sink_end=sink_end, recent_begin=recent_begin, protect=protect,
                              pool=recent_begin - sink_end, row=[_score(x) for x in scores[b][h][:n]]))
        if reference == "authors":
            out.append(_authors(heads, alpha))
        else:
            out.append(_kvpress(heads, alpha))
    return out


def _authors(heads, alpha):
    if all(a["kept"] == a["n"] for a in heads):  # the budget covers the prompt: no compression (§5.1 step 2)
        return [a["n"] for a in heads]
    budgets = [max(a["kept"] - a["protect"], 0) for a in heads]  # B_h, the prefix budget (C - w)
    candidates = [(a["row"][t], h, t) for h, a in enumerate(heads) for t in range(a["sink_end"], a["recent_begin"])]
    # explicit stable sort: score descending, then head, then index ascending
    candidates = sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))
    winners = [0] * len(heads)
    for _, h, _ in candidates[: sum(budgets)]:
        winners[h] += 1
    totals = []
    for a, c, bh_budget in zip(heads, winners, budgets):
        bh = round_half_even((1.0 - alpha) * c + math.floor(alpha * bh_budget))
        totals.append(min(bh, a["pool"]) + a["protect"])
    return totals


def _is_protected(a, t):
    return t < a["sink_end"] or t >= a["recent_begin"]


def _kvpress(heads, alpha):
    pinned = []
    for a in heads:
        safe = min(math.floor(alpha * a["kept"]), a["n"])
        # the head's own order: protected tokens first (kvpress's max + 1), then score descending, index ascending
        order = sorted(range(a["n"]), key=lambda t: (0, 0.0, t) if _is_protected(a, t) else (1, -a["row"][t], t))
        pinned.append(set(order[:safe]))
    rest = sum(a["kept"] - len(p) for a, p in zip(heads, pinned))
    pool = []
    for h, a in enumerate(heads):
        for t in range(a["n"]):
            if t in pinned[h]:
                continue
            pool.append((0, 0.0, h, t) if _is_protected(a, t) else (1, -a["row"][t], h, t))
    pool = sorted(pool)  # protected first (head, index), then score descending, head, index
    winners = [0] * len(heads)
    for *_, h, _ in pool[: max(rest, 0)]:
        winners[h] += 1
    return [len(p) + w for p, w in zip(pinned, winners)]


def top_k_kept(row, n, total, n_sink=0, n_recent=0):
    """Kept indices (ascending) of one head: its protected tokens and the best unprotected (score desc, index asc)."""
    sink_end, recent_begin = protected_windows(n, n_sink, n_recent)
    protected = list(range(sink_end)) + list(range(recent_begin, n))
    k = min(n, max(total, len(protected)))
    middle = sorted(range(sink_end, recent_begin), key=lambda t: (-_score(row[t]), t))
    return sorted(protected + middle[: k - len(protected)])


def ada_kv_kept(scores, lengths, totals, n_sink=0, n_recent=0):
    """Kept index lists [B][H] of the TopK selection over the per-head totals."""
    return [[top_k_kept(scores[b][h], int(lengths[b][h]), totals[b][h], n_sink, n_recent)
             for h in range(len(totals[b]))] for b in range(len(totals))]


def global_winner_counts(scores, lengths, budget_per_head):
    """c_h of §5.1 step 4 for one sequence without protection: winners of the global top-(H B) (a check helper)."""
    cand = sorted(((-_score(scores[h][t]), h, t) for h in range(len(scores)) for t in range(int(lengths[h]))))
    c = [0] * len(scores)
    for _, h, _ in cand[: len(scores) * budget_per_head]:
        c[h] += 1
    return c


def pyramid_authors(n, capacity, window, beta, layers):
    """The authors' per-layer totals (window included) for a prompt of n tokens (§6.1)."""
    C, w = capacity, window
    Bp = C - w
    if n < C:
        return [n] * layers
    if n < 2 * Bp:
        return [C] * layers
    min_num = Bp // beta
    max_num = 2 * Bp - min_num
    if max_num >= n - w:
        max_num = n - w
        min_num = 2 * Bp - max_num
    steps = (max_num - min_num) // (layers - 1)
    return [max_num - layer * steps + w for layer in range(layers)]


def pyramid_kvpress(n, ratio, window, beta, layers):
    """kvpress PyramidKVPress's per-layer totals (window included) for a prompt of n tokens (§2.9)."""
    w = window
    cap = w + n * (1 - ratio)
    min_n = (cap - w) / beta
    max_n = 2 * (cap - w) - min_n
    if max_n >= n - w:
        max_n = n - w
        min_n = 2 * (cap - w) - max_n
    if not (n >= max_n >= min_n >= w):
        return [round_half_even(n * (1 - ratio))] * layers
    step = (max_n - min_n) / (layers - 1)
    return [round_half_even(max_n - layer * step) for layer in range(layers)]
