# SPDX-License-Identifier: Apache-2.0
"""Self-check of uncomp.py (the UNComp float64 oracle) against hand cases and the properties of
shared/specs/uncomp.md §8: the entropy's worked values (isotropic D = 128, k = 32: H_32 = 1.2130076; rank 1: 0; two
directions: ln 2), its bounds and invariances, the eigen / Gram / SVD paths, degenerate inputs; balanced groups,
ranking-only grouping, the majority vote; the budget closed form ([643, ..., 125]), conservation, monotonicity and
clamping; the layer partition and hidden-state counts (the code's Llama2/Llama3 lists); the prefill selection against
explicit loops (nested kept sets, the window always kept); and the decode update against a brute-force history of
every query's attention (one eviction per step, the argmin of the pooled score, the window never evicted).
Run: python3 tools/reference/test_uncomp.py (exit 0 = pass, 1 = fail, 77 = NumPy missing).
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from selftest import check, finish, require_numpy  # noqa: E402

np = require_numpy()
import uncomp as uc  # noqa: E402


def near(name, a, b, tol):
    a, b = float(a), float(b)
    check(name, abs(a - b) <= tol, f"{a!r} vs {b!r} (tol {tol:g})")


# ------------------------------------------------------------------------------------------------- entropy
def test_entropy():
    D = 128
    iso = np.vstack([np.eye(D), -np.eye(D)])
    for nr in (True, False):
        e = uc.matrix_entropy(iso, 32, normalize_rows=nr)
        tag = "rows" if nr else "cov"
        near(f"isotropic H_32 ({tag})", e["truncated"], 1.2130076, 5e-8)
        near(f"isotropic H_32 = (k/D) ln D ({tag})", e["truncated"], 32 / D * math.log(D), 1e-12)
        near(f"isotropic normalized 0.25 ({tag})", e["normalized"], 0.25, 1e-12)
        near(f"isotropic erank_32 ({tag})", e["erank"], 3.3635857, 5e-8)
        near(f"isotropic H = ln D ({tag})", e["full"], math.log(D), 1e-12)
        r = uc.matrix_entropy(iso, 32, normalize_rows=nr, renormalize_topk=True)
        near(f"isotropic renormalized H_32 = ln 32 ({tag})", r["truncated"], math.log(32), 1e-12)
        near(f"isotropic renormalized H unchanged ({tag})", r["full"], math.log(D), 1e-12)
    rng = np.random.default_rng(1)
    # rank 1: X = a vᵀ + 1 bᵀ, a non-constant
    a, v, b = rng.standard_normal(50), rng.standard_normal(16), rng.standard_normal(16)
    for nr in (True, False):
        e = uc.matrix_entropy(np.outer(a, v) + b, 4, normalize_rows=nr)
        near(f"rank 1 H_k ({nr})", e["truncated"], 0, 1e-8)
        near(f"rank 1 H ({nr})", e["full"], 0, 1e-8)
        near(f"rank 1 erank ({nr})", e["erank"], 1, 1e-8)
    two = np.array([[1, 0, 0, 0], [-1, 0, 0, 0], [0, 1, 0, 0], [0, -1, 0, 0]], dtype=float)
    for k in (2, 3, 4, 32):
        e = uc.matrix_entropy(two, k)
        near(f"two directions H_{k} = ln 2", e["truncated"], math.log(2), 1e-12)
        near(f"two directions erank_{k} = 2", e["erank"], 2, 1e-12)
    # degenerate: n = 1, constant rows
    for x in (rng.standard_normal((1, 8)), np.tile(rng.standard_normal(8), (5, 1))):
        e = uc.matrix_entropy(x, 4)
        check("degenerate: H_k = H = 0, erank 1, finite",
              e["truncated"] == 0 and e["full"] == 0 and e["erank"] == 1 and e["normalized"] == 0, str(e))
    # zero centred rows are skipped in row-normalised mode: a row equal to the mean changes nothing but the count
    x = rng.standard_normal((9, 6))
    x = np.vstack([x, x.mean(axis=0)])  # its centred row is zero
    lam = uc.spectrum(x)
    near("zero centred row skipped: Σλ = 1", lam.sum(), 1, 1e-12)
    near("zero centred row skipped: same spectrum",
         np.abs(lam - uc.spectrum(np.vstack([x[:9], x[:9].mean(axis=0)]), True)).max(), 0, 1e-12)
    # bounds, monotone in k, H_k = H for k >= rank, normalisation, invariances, Gram / SVD paths
    for trial in range(12):
        n, D = int(rng.integers(2, 40)), int(rng.integers(2, 24))
        x = rng.standard_normal((n, D)) * np.exp(-rng.uniform(0, 3) * np.arange(D) / D) + rng.standard_normal(D)
        for nr in (True, False):
            lam = uc.spectrum(x, nr)
            near(f"Σλ = 1 ({trial}, {nr})", lam.sum(), 1, 1e-12)
            check(f"λ sorted, >= 0 ({trial}, {nr})", np.all(lam >= 0) and np.all(np.diff(lam) <= 0))
            for method in ("gram", "svd"):
                other = uc.spectrum(x, nr, method)
                m = min(len(lam), len(other))
                near(f"{method} == eigh spectrum ({trial}, {nr})", np.abs(lam[:m] - other[:m]).max(initial=0), 0,
                     1e-12)
                near(f"{method} == eigh: the rest is zero ({trial}, {nr})",
                     max(lam[m:].max(initial=0), other[m:].max(initial=0)), 0, 1e-12)
            hs = [uc.matrix_entropy(x, k, nr)["truncated"] for k in range(1, D + 2)]
            full = uc.matrix_entropy(x, 1, nr)["full"]
            rank = int(np.sum(lam > 1e-12))
            check(f"0 <= H_k <= H <= ln rank <= ln D ({trial}, {nr})",
                  min(hs) >= 0 and max(hs) <= full + 1e-12 and full <= math.log(max(rank, 1)) + 1e-12
                  and full <= math.log(D) + 1e-12)
            if min(n, D) >= 3:
                check(f"H_k non-decreasing in k ({trial}, {nr})", all(b >= a - 1e-15 for a, b in zip(hs, hs[1:])))
            near(f"H_k = H for k >= rank ({trial}, {nr})", hs[-1], full, 1e-12)
            e = uc.matrix_entropy(x, 4, nr)
            check(f"1 <= erank_k <= erank ({trial}, {nr})", 1 - 1e-15 <= e["erank"] <= math.exp(full) + 1e-12)
            Q, _ = np.linalg.qr(rng.standard_normal((D, D)))
            for tname, y in (("scale", 3.7 * x), ("translation", x + rng.standard_normal(D)), ("rotation", x @ Q),
                             ("permutation", x[rng.permutation(n)])):
                f = uc.matrix_entropy(y, 4, nr)
                near(f"invariant under {tname} ({trial}, {nr})", f["truncated"], e["truncated"], 1e-10)
                near(f"invariant under {tname}: H ({trial}, {nr})", f["full"], e["full"], 1e-10)
    # ridge: + ridge to every normalised eigenvalue
    x = rng.standard_normal((60, 8))
    lam = uc.spectrum(x) + 1e-3
    e = uc.matrix_entropy(x, 3, ridge=1e-3)
    near("ridge: H_k of λ + ridge", e["truncated"], -np.sum(lam[:3] * np.log(lam[:3])), 1e-13)
    near("ridge: H of λ + ridge", e["full"], -np.sum(lam * np.log(lam)), 1e-13)
    # entropy_table over a batch == per-row calls
    q = rng.standard_normal((2, 3, 20, 5))
    t = uc.entropy_table(q, 15, 2, False, True, 1e-10)
    e = uc.matrix_entropy(q[1, 2, :15], 2, False, True, 1e-10)
    near("entropy_table == matrix_entropy", np.abs(t[1, 2] - [e["truncated"], e["full"], e["erank"],
                                                               e["normalized"]]).max(), 0, 0)


# -------------------------------------------------------------------------------------------------- groups
def test_groups():
    for H in range(1, 40):
        for M in range(1, H + 1):
            s = uc.balanced_group_sizes(H, M)
            check(f"sizes ({H}, {M})", sum(s) == H and max(s) - min(s) <= 1, str(s))
            if (H % M) % 2 == 0:
                check(f"sizes symmetric ({H}, {M})", s == s[::-1], str(s))
    check("sizes 32/3 (the authors' 11/10/11)", uc.balanced_group_sizes(32, 3) == [11, 10, 11])
    check("sizes 32/5 (the authors' 7/6/6/6/7)", uc.balanced_group_sizes(32, 5) == [7, 6, 6, 6, 7])
    check("sizes 28/8", uc.balanced_group_sizes(28, 8) == [4, 4, 3, 3, 3, 3, 4, 4])
    check("sizes 7/4: the odd one to group 1", uc.balanced_group_sizes(7, 4) == [2, 2, 1, 2])
    check("sizes 32/3 first", uc.balanced_group_sizes(32, 3, "first") == [11, 11, 10])
    check("sizes 32/3 last", uc.balanced_group_sizes(32, 3, "last") == [10, 11, 11])
    # hand case: entropies with a tie; group 0 = highest; tie to the lower index
    e = [0.5, 0.9, 0.1, 0.9, 0.3, 0.7]
    check("group_heads hand case", uc.group_heads(e, 3) == [1, 0, 2, 0, 2, 1], str(uc.group_heads(e, 3)))
    check("group_heads tie: lower index first", uc.group_heads(e, 6) == [3, 0, 5, 1, 4, 2], str(uc.group_heads(e, 6)))
    rng = np.random.default_rng(2)
    for trial in range(20):
        H = int(rng.integers(1, 33))
        M = int(rng.integers(1, H + 1))
        e = rng.uniform(0.5, 3.0, H)
        g = uc.group_heads(e, M)
        check(f"monotone transforms give the same groups ({trial})",
              g == uc.group_heads(np.log(e), M) == uc.group_heads(np.exp(e) * 7, M))
        sizes = [g.count(i) for i in range(M)]
        check(f"group sizes balanced ({trial})", sizes == uc.balanced_group_sizes(H, M))
        check(f"higher entropy, lower group ({trial})",
              all(g[a] <= g[b] for a in range(H) for b in range(H) if e[a] > e[b]))
        # a vote over identical samples is the single sample's grouping
        check(f"vote of identical samples ({trial})", uc.majority_vote_groups([g] * 3, M) == g)
    # vote hand case: H = 4, M = 2; votes for label 0: h0 2, h1 1, h2 2, h3 1 -> h0, h2 (tie 2/2 -> lower)
    labels = [[0, 1, 0, 1], [0, 0, 1, 1], [1, 1, 0, 0]]
    check("vote hand case", uc.majority_vote_groups(labels, 2) == [0, 1, 0, 1])
    labels = [[0, 0, 1, 1], [0, 1, 0, 1], [1, 0, 0, 1]]  # label 0 votes: 2, 2, 1, 0 -> h0, h1
    check("vote hand case 2", uc.majority_vote_groups(labels, 2) == [0, 0, 1, 1])
    check("reduce_to_kv_heads", np.allclose(uc.reduce_to_kv_heads([1, 3, 5, 7, 2, 2], 3), [2, 6, 2]))


# ------------------------------------------------------------------------------------------------- budgets
def test_budgets():
    g8 = list(range(8))
    check("B̄ 384 M 8 Δ 74", uc.head_budgets(384, 8, 74, g8, 8) == [643, 569, 495, 421, 347, 273, 199, 125],
          str(uc.head_budgets(384, 8, 74, g8, 8)))
    check("paper 640/74", uc.paper_budgets(640, 74, g8, 8) == [640, 566, 492, 418, 344, 270, 196, 122])
    check("code list", uc.list_budgets([640, 567, 494, 421, 348, 275, 202, 129], g8, 8)
          == [640, 567, 494, 421, 348, 275, 202, 129])
    # group budgets: exact mean B̄ for equal and unequal sizes
    for sizes in ([4] * 8, [11, 11, 10], [4, 4, 4, 4, 3, 3, 3, 3], [1], [2, 1]):
        per = uc.group_budgets(384, 74, sizes)
        check(f"Σ n_g N_g = H B̄ {sizes}", sum(n * x for n, x in zip(sizes, per)) == 384 * sum(sizes))
    # largest remainder hand case: H = 4, M = 4, B̄ 30, Δ 7: [40.5, 33.5, 26.5, 19.5] -> total 120, +1 to heads 0, 1
    check("largest remainder ties to the lower head", uc.head_budgets(30, 4, 7, [0, 1, 2, 3], 4) == [41, 34, 26, 19])
    check("largest remainder ties by group first", uc.head_budgets(30, 4, 7, [3, 2, 1, 0], 4) == [19, 26, 34, 41])
    # groups [0, 0, 1, 1], B̄ 10.25, Δ 3: [11.75, 11.75, 8.75, 8.75], total 41: group 0 first, then the lower head
    check("largest remainder within a group: lower head", uc.head_budgets(10.25, 2, 3, [0, 0, 1, 1], 0) == [12, 12, 9, 8])
    rng = np.random.default_rng(3)
    for trial in range(40):
        H = int(rng.integers(1, 41))
        M = int(rng.integers(1, H + 1))
        avg = float(rng.choice([384, 64, 100.5, float(rng.uniform(20, 500))]))
        step = float(rng.choice([74, 0, 10.25, float(rng.uniform(0, 40))]))
        e = rng.uniform(0, 1, H)
        g = uc.group_heads(e, M)
        bud = uc.head_budgets(avg, M, step, g, 0)
        target = math.floor(H * avg + 0.5)
        if min(bud) > 0 and min(uc.group_budgets(avg, step, uc.balanced_group_sizes(H, M))) >= 0:
            check(f"conservation Σ = round(H B̄) ({trial})", sum(bud) == target, f"{sum(bud)} vs {target}")
        # ties in the remainder go to the lower group, then the lower head, so heads of one group may differ by 1;
        # across groups the order holds whenever Δ >= 1
        check(f"one group: budgets within 1 ({trial})",
              all(abs(bud[a] - bud[b]) <= 1 for a in range(H) for b in range(H) if g[a] == g[b]))
        if step >= 1:
            check(f"monotone across groups ({trial})",
                  all(bud[a] >= bud[b] for a in range(H) for b in range(H) if g[a] < g[b]))
        real = uc.group_budgets(avg, step, uc.balanced_group_sizes(H, M))
        if min(real) >= 0:
            check(f"within 1 of the real budget ({trial})", all(abs(bud[h] - real[g[h]]) < 1 for h in range(H)))
        if step == 0 or M == 1:
            check(f"Δ = 0 or M = 1: uniform ({trial})", max(bud) - min(bud) <= 1)
        w = int(rng.integers(1, 200))
        check(f"clamp to >= w ({trial})", uc.head_budgets(avg, M, step, g, w) == [max(w, b) for b in bud])
    check("integer B̄, Δ = 0: exactly B̄", uc.head_budgets(64, 3, 0, [0, 1, 2, 0, 1], 8) == [64] * 5)


# -------------------------------------------------------------------------------------------------- layers
def test_layers():
    s = [10, 9.9, 8.0, 7.9, 7.8, 5.0, 5.1, 3.0]
    check("partition ε 1", uc.partition_layers(s, 1.0) == [0, 0, 1, 1, 1, 2, 2, 3])
    check("partition ε = inf: one stage", uc.partition_layers(s, math.inf) == [0] * 8)
    check("partition drop == ε does not split", uc.partition_layers([3, 2, 1], 1.0) == [0, 0, 0])
    check("partition count 3", uc.partition_layers_count(s, 3) == [0, 0, 0, 0, 0, 1, 1, 2])
    check("partition count tie -> lower layer", uc.partition_layers_count([3, 2, 1, 0], 2) == [0, 1, 1, 1])
    rng = np.random.default_rng(4)
    for trial in range(10):
        sc = list(np.cumsum(-rng.exponential(1, 20)) + 50)
        counts = [max(uc.partition_layers(sc, eps)) + 1 for eps in (0, 0.5, 1, 2, 5)]
        check(f"stage count non-increasing in ε ({trial})", counts == sorted(counts, reverse=True))
        drops = sum(1 for l in range(1, 20) if sc[l - 1] - sc[l] > 1.0)
        check(f"stages = 1 + drops ({trial})", max(uc.partition_layers(sc, 1.0)) + 1 == 1 + drops)
        for C in (1, 3, 6):
            st = uc.partition_layers_count(sc, C)
            check(f"count partition has C stages, contiguous ({trial}, {C})",
                  max(st) + 1 == C and st[0] == 0 and all(b - a in (0, 1) for a, b in zip(st, st[1:])))
    check("Llama2 hidden-state counts", uc.hidden_state_counts(4096, 5, 1536) == [4096, 3456, 2816, 2176, 1536])
    check("Llama3 hidden-state counts", uc.hidden_state_counts(8192, 5, 1536) == [8192, 6528, 4864, 3200, 1536])
    check("explicit step 512", uc.hidden_state_counts(3000, 5, 1536, 512) == [3000, 2488, 1976, 1536, 1536])
    check("no pruning when n <= min", uc.hidden_state_counts(1000, 5, 1536) == [1000] * 5)
    for trial in range(10):
        n, keep, w = int(rng.integers(1, 60)), int(rng.integers(0, 70)), int(rng.integers(0, 10))
        u = np.round(rng.uniform(0, 1, n), 1)  # exact ties
        got = uc.select_hidden_states(u, keep, w)
        forced = set(range(max(0, n - w), n))
        rest = sorted((i for i in range(n) if i not in forced), key=lambda i: (-u[i], i))
        want = sorted(forced | set(rest[: max(0, min(keep, n) - len(forced))]))
        check(f"select_hidden_states brute force ({trial})", got == want)
    keys, queries = rng.standard_normal((2, 30, 4)), rng.standard_normal((4, 30, 4))
    u = uc.hidden_state_scores(keys, queries, 8)
    want = np.zeros(30)
    for h in range(4):
        for i in range(22, 30):
            z = keys[h // 2, : i + 1] @ queries[h, i] / 2
            p = np.exp(z - z.max())
            want[: i + 1] += p / p.sum()
    near("hidden_state_scores brute force", np.abs(u - want).max(), 0, 1e-12)
    near("hidden_state_scores sum = heads × w", u.sum(), 32, 1e-12)


# ------------------------------------------------------------------------------------------------ prefill
def brute_window_rows(K, Q, w):
    """A_full by explicit loops: K [Hkv, N, d], Q [Hq, w, d]."""
    Hkv, N, d = K.shape
    g = Q.shape[0] // Hkv
    A = np.zeros((Hkv, N, w))
    for hq in range(Q.shape[0]):
        for r in range(w):
            pos = N - w + r
            z = np.array([K[hq // g, j] @ Q[hq, r] / math.sqrt(d) for j in range(pos + 1)])
            p = np.exp(z - z.max())
            A[hq // g, : pos + 1, r] += p / p.sum()
    return A


def test_pool():
    rng = np.random.default_rng(5)
    for m in (1, 2, 3, 4, 7, 8, 20):
        x = rng.standard_normal(m)
        padded = np.concatenate([np.full(3, -np.inf), x, np.full(3, -np.inf)])
        want = np.array([padded[j: j + 7].max() for j in range(m)])
        check(f"max_pool == −inf padded reference ({m})", np.array_equal(uc.max_pool(x, 7), want))


def test_prefill():
    rng = np.random.default_rng(6)
    for trial in range(6):
        Hkv, g, N, d, w = 2, int(rng.integers(1, 4)), int(rng.integers(12, 50)), 8, int(rng.integers(1, 9))
        K = rng.standard_normal((1, Hkv, N, d))
        Q = 2 * rng.standard_normal((1, Hkv * g, w, d))
        A = uc.group_window_rows(K, Q)
        near(f"window rows == loops ({trial})", np.abs(A[0] - brute_window_rows(K[0], Q[0], w)).max(), 0, 1e-12)
        near(f"each window row sums to g ({trial})", np.abs(A.sum(axis=2) - g).max(), 0, 1e-12)
        results = {}
        for budget in range(w, N + 4):
            pooled, kept, gap = uc.prefill_head(A[0, 0], budget, w)
            b = min(N, budget)
            results[budget] = set(kept.tolist())
            check(f"size min(N, budget) ({trial}, {budget})", len(kept) == b and len(set(kept.tolist())) == b)
            check(f"ascending ({trial}, {budget})", np.all(np.diff(kept) > 0))
            check(f"window kept ({trial}, {budget})", set(range(N - w, N)) <= results[budget])
            # brute-force top-(b − w) of the pooled prefix
            ref_pool = [max(A[0, 0, i, :].sum() for i in range(max(0, j - 3), min(N - w, j + 4))) for j in range(N - w)]
            near(f"pooled == loops ({trial}, {budget})", np.abs(pooled - ref_pool).max(initial=0), 0, 1e-12)
            order = sorted(range(N - w), key=lambda j: (-ref_pool[j], j))
            check(f"top-k brute force ({trial}, {budget})",
                  results[budget] == set(order[: b - w]) | set(range(N - w, N)))
        bs = sorted(results)
        check(f"nested kept sets ({trial})", all(results[a] <= results[b] for a, b in zip(bs, bs[1:])))
    # GQA: prefill() == per-head calls
    K = rng.standard_normal((2, 2, 30, 4))
    Q = rng.standard_normal((2, 6, 5, 4))
    A, pooled, kept, gaps = uc.prefill(K, Q, [12, 20], 5)
    for b in range(2):
        for h in range(2):
            p2, k2, _ = uc.prefill_head(A[b, h], [12, 20][h], 5)
            check(f"prefill == prefill_head ({b}, {h})", np.array_equal(kept[b][h], k2) and np.array_equal(
                pooled[b, h], p2))
    check("budget <= w keeps the last budget", np.array_equal(uc.select_prefix(np.zeros(10), 14, 4, 3)[0],
                                                              [11, 12, 13]))


# ------------------------------------------------------------------------------------------------- decode
def brute_decode(K, Q, kept, budget, w, T):
    """Decode by a history of every query's group-summed attention: hist[ρ] = {slot position: probability}."""
    Hq, total, d = Q.shape
    N = total - T
    hist = {}
    for r in range(w):  # the prefill window rows, over the whole prompt
        pos = N - w + r
        row = {}
        for hq in range(Hq):
            z = K[: pos + 1] @ Q[hq, pos] / math.sqrt(d)
            p = np.exp(z - z.max())
            p /= p.sum()
            for j in range(pos + 1):
                row[j] = row.get(j, 0.0) + p[j]
        hist[pos] = row
    slots = list(kept)
    evicted = []
    for t in range(T):
        pos = N + t
        slots.append(pos)
        row = {}
        for hq in range(Hq):
            z = np.array([K[j] @ Q[hq, pos] for j in slots]) / math.sqrt(d)
            p = np.exp(z - z.max())
            p /= p.sum()
            for j, pj in zip(slots, p):
                row[j] = row.get(j, 0.0) + pj
        hist[pos] = row
        if len(slots) <= budget:
            evicted.append(-1)
            continue
        m = len(slots) - w
        raw = [sum(hist[rho].get(slots[i], 0.0) for rho in range(pos - w + 1, pos + 1)) for i in range(m)]
        pooled = [max(raw[max(0, i - 3): i + 4]) for i in range(m)]
        i = min(range(m), key=lambda x: (pooled[x], -x))  # ties: the higher index goes (top-k keeps the lower)
        evicted.append(slots[i])
        del slots[i]
    return evicted, slots


def test_decode():
    rng = np.random.default_rng(7)
    for trial in range(8):
        Hkv, g, N, d, w, T = 2, int(rng.integers(1, 4)), int(rng.integers(15, 40)), 8, int(rng.integers(1, 9)), 7
        K = rng.standard_normal((1, Hkv, N + T, d))
        Q = 2 * rng.standard_normal((1, Hkv * g, N + T, d))
        budgets = [int(rng.integers(w, N)), N + T + int(rng.integers(-3, 3))]
        A, pooled, kept, gaps = uc.prefill(K[:, :, :N], Q[:, :, N - w: N], budgets, w)
        for h in range(Hkv):
            ev, final, dg = uc.decode_head(K[0, h], Q[0, h * g:(h + 1) * g], g, kept[0][h], A[0, h], budgets[h], w, T)
            bev, bfinal = brute_decode(K[0, h], Q[0, h * g:(h + 1) * g], kept[0][h].tolist(), budgets[h], w, T)
            check(f"decode == brute-force history ({trial}, {h})", ev == bev and final == bfinal,
                  f"{ev} vs {bev}")
            size = len(kept[0][h])
            for t, e in enumerate(ev):
                grown = size + 1
                if grown > budgets[h]:
                    check(f"one eviction per step over budget ({trial}, {h}, {t})", e >= 0)
                    check(f"window never evicted ({trial}, {h}, {t})", e < N + t + 1 - w)
                    size = grown - 1
                else:
                    check(f"no eviction under budget ({trial}, {h}, {t})", e == -1)
                    size = grown
            check(f"final size ({trial}, {h})", len(final) == size == min(budgets[h], N + T))
            check(f"final ascending and unique ({trial}, {h})", final == sorted(set(final)))
            check(f"the last w always kept ({trial}, {h})", set(range(N + T - w, N + T)) <= set(final))
    # one decode step by hand: after it, exactly one slot is gone and it is the argmin of the pooled score
    K = rng.standard_normal((1, 1, 21, 4))
    Q = rng.standard_normal((1, 2, 21, 4))
    A, pooled, kept, _ = uc.prefill(K[:, :, :20], Q[:, :, 16:20], [10], 4)
    ev, final, _ = uc.decode_head(K[0, 0], Q[0], 2, kept[0][0], A[0, 0], 10, 4, 1)
    check("a decode step evicts exactly one", len(final) == 10 and len(set(kept[0][0].tolist()) | {20}) - len(final)
          == 1 and ev[0] in kept[0][0])


def main():
    test_entropy()
    test_groups()
    test_budgets()
    test_layers()
    test_pool()
    test_prefill()
    test_decode()
    finish("uncomp: entropy (isotropic, rank 1, two directions, bounds, invariances, eigh/Gram/SVD, ridge), groups "
           "(balanced, ties, vote), budgets (closed form, conservation, rounding ties, clamp), layers, hidden states, "
           "prefill (loops, nested) and decode (brute-force history) hold")


if __name__ == "__main__":
    main()
