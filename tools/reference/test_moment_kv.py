# SPDX-License-Identifier: Apache-2.0
"""Self-check of moment_kv.py (the MomentKV float64 oracle) against brute-force definitions and the properties of
shared/specs/moment_kv.md §8 and §10: Welford == raw sums == two-pass, Chan merges == sequential adds (order free),
n = 1 corrected == full attention, the other exactness cases, Jensen Ẑ_E ≤ Z_E with Z_E/Ẑ_E = 1 + ρ̄, the mixing
weight bias, the error identity, the three formulations of the merge, stability near ±1000, the clamp, the base
score against explicit loops, the MI score's special cases, and the prefill rounds: N − L rounds == a literal
greedy loop on raw sums, 1 round == one-shot top-k of α‖v‖. Run: python3 tools/reference/test_moment_kv.py
(exit 0 = pass, 1 = fail, 77 = NumPy missing).
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from selftest import check, finish, require_numpy  # noqa: E402

np = require_numpy()
import moment_kv as mk  # noqa: E402


def close(name, a, b, tol=1e-12, rel=True):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        check(name, False, f"shapes {a.shape} vs {b.shape}")
        return
    scale = max(1.0, float(np.abs(b).max(initial=0.0))) if rel else 1.0
    err = float(np.abs(a - b).max(initial=0.0)) / scale
    check(name, err <= tol, f"max |diff| {err:.3e} > {tol:.1e}")


def same_moments(name, a, b, tol=1e-12):
    check(f"{name}: n", a["n"] == b["n"], f"{a['n']} vs {b['n']}")
    for f in ("km", "vm", "C"):
        close(f"{name}: {f}", a[f], b[f], tol)


def raw_moments(K, V):
    """The paper's raw sums (spec §2.3 Eq. 25), accumulated token by token."""
    n, sk, sv, S = 0, np.zeros(K.shape[1]), np.zeros(V.shape[1]), np.zeros((V.shape[1], K.shape[1]))
    for k, v in zip(K, V):
        n, sk, sv, S = n + 1, sk + k, sv + v, S + np.outer(v, k)
    return n, sk, sv, S


def full_attention(q, K, V, c):
    s = c * (K @ q)
    e = np.exp(s - s.max())
    return e @ V / e.sum(), s.max() + math.log(e.sum())


# ------------------------------------------------------------------------------------------------ statistics
def test_moments():
    rng = np.random.default_rng(11)
    for trial in range(10):
        dk, dv, n = rng.integers(2, 9), rng.integers(2, 9), rng.integers(1, 40)
        K = rng.standard_normal((n, dk)) * rng.uniform(0.5, 3) + rng.standard_normal(dk)
        V = rng.standard_normal((n, dv)) + rng.standard_normal(dv)
        direct = mk.moments_of(K, V)
        seq = mk.empty_moments(dk, dv)
        for k, v in zip(K, V):
            seq = mk.add_token(seq, k, v)
        same_moments(f"Welford == two-pass ({trial})", seq, direct, 1e-12)
        # raw sums: S − s_v s_kᵀ/n == C, and the conversion (§2.3)
        rn, sk, sv, S = raw_moments(K, V)
        close(f"raw S − s_v s_kᵀ/n == C ({trial})", S - np.outer(sv, sk) / rn, direct["C"], 1e-11)
        cn, csk, csv, cS = mk.raw_sums(direct)
        check(f"raw n ({trial})", cn == rn)
        close(f"raw s_k, s_v, S from Welford ({trial})", np.concatenate([csk, csv, cS.ravel()]),
              np.concatenate([sk, sv, S.ravel()]), 1e-12)
        # C = Σ (v − v̄)(k − k̄)ᵀ = Σ v (k − k̄)ᵀ
        close(f"C = Σ v (k − k̄)ᵀ ({trial})", V.T @ (K - K.mean(0)), direct["C"], 1e-12)
        # block fold == sequential adds, any split, any order, merge commutative and associative
        perm = rng.permutation(n)
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(3, n - 1), replace=False)) if n > 1 else []
        acc = mk.empty_moments(dk, dv)
        for block in np.split(perm, cuts):
            acc = mk.merge(acc, mk.moments_of(K[block], V[block]))
        same_moments(f"block folds (permuted) == sequential ({trial})", acc, seq, 1e-12)
        if n >= 3:
            a, b, c = (mk.moments_of(K[s], V[s]) for s in np.split(np.arange(n), [n // 3, 2 * n // 3]))
            same_moments(f"merge associative ({trial})", mk.merge(mk.merge(a, b), c), mk.merge(a, mk.merge(b, c)))
            same_moments(f"merge commutative ({trial})", mk.merge(a, b), mk.merge(b, a))
        # translation invariance of C (§10.5)
        t = mk.moments_of(K + rng.standard_normal(dk), V - rng.standard_normal(dv))
        close(f"C invariant to translations ({trial})", t["C"], direct["C"], 1e-11)
    z = mk.merge(mk.empty_moments(3, 2), mk.empty_moments(3, 2))
    check("empty ⊕ empty is empty", z["n"] == 0 and not z["C"].any() and not z["km"].any())
    # clamp (§10.20)
    C = np.array([[1e-7, -5e-7, 2e-6], [-1e-6, 0.3, -9.9e-7]])
    close("clamp tau=1e-6", mk.clamp(C, 1e-6), [[0, 0, 2e-6], [-1e-6, 0.3, 0]], 0)
    close("clamp tau=0 is identity", mk.clamp(C, 0.0), C, 0)


# ------------------------------------------------------------------------------------------------ correction
def evicted_parts(q, KE, VE, c):
    s = c * (KE @ q)
    ZE = np.exp(s).sum()
    return ZE, np.exp(s) @ VE / ZE


def test_correction():
    rng = np.random.default_rng(12)
    for trial in range(40):
        dk, dv = rng.integers(2, 9), rng.integers(2, 9)
        nr, ne = rng.integers(1, 20), rng.integers(1, 20)
        c = 1.0 / math.sqrt(dk)
        K = rng.standard_normal((nr + ne, dk)) * rng.uniform(0.2, 1.5)
        V = rng.standard_normal((nr + ne, dv))
        q = rng.standard_normal(dk) * rng.uniform(0.5, 3)
        KR, VR, KE, VE = K[:nr], V[:nr], K[nr:], V[nr:]
        pos = np.arange(nr)
        m = mk.moments_of(KE, VE)
        out, lse, o_r, lse_r = mk.corrected_row(q, 10 ** 6, KR, VR, pos, m, c, 0.0)
        f, _ = full_attention(q, K, V, c)
        fr, lr = full_attention(q, KR, VR, c)
        close(f"o_R, lse_R ({trial})", np.append(o_r, lse_r), np.append(fr, lr), 1e-12)
        ZE, fE = evicted_parts(q, KE, VE, c)
        ZR = math.exp(lr)
        delta = c * ((KE - m["km"]) @ q)
        rho = np.exp(delta) - 1 - delta
        Zhat = ne * math.exp(c * q @ m["km"])
        check(f"Jensen Ẑ_E <= Z_E ({trial})", Zhat <= ZE * (1 + 1e-12), f"{Zhat} > {ZE}")
        close(f"Z_E / Ẑ_E == 1 + ρ̄ ({trial})", ZE / Zhat, 1 + rho.mean(), 1e-11)
        var = (delta ** 2).mean()
        sig = np.abs(delta).max()
        check(f"½Var e^-σ <= ρ̄ <= ½Var e^σ ({trial})",
              0.5 * var * math.exp(-sig) * (1 - 1e-9) <= rho.mean() <= 0.5 * var * math.exp(sig) * (1 + 1e-9) + 1e-15)
        # the three formulations (§10.17): log-domain merge == virtual token == direct Eq. 12
        fhat = m["vm"] + (c / ne) * (m["C"] @ q)
        num = np.exp(c * KR @ q) @ VR + math.exp(c * q @ m["km"]) * (ne * m["vm"] + c * m["C"] @ q)
        close(f"merge == virtual token ({trial})", out, num / (ZR + Zhat), 1e-11)
        wr_hat = ZR / (ZR + Zhat)
        close(f"merge == Eq. 12 ({trial})", out, wr_hat * fr + (1 - wr_hat) * fhat, 1e-11)
        close(f"lse == log(Z_R + Ẑ_E) ({trial})", lse, math.log(ZR + Zhat), 1e-12)
        # mixing-weight bias (§8.7) and the corrected-output error identity (§8.8)
        wr = ZR / (ZR + ZE)
        close(f"ŵ_R − w_R == w_R ŵ_E ρ̄ ({trial})", wr_hat - wr, wr * (1 - wr_hat) * rho.mean(), 1e-12)
        close(f"f − f̂ identity ({trial})", f - out, (1 - wr) * (fE - fr) - (1 - wr_hat) * (fhat - fr), 1e-11)
        # centred error bound (§8.4)
        bound = rho.mean() / (1 + rho.mean()) * (np.linalg.norm(VE - m["vm"], axis=1).max() +
                                                 np.linalg.norm((c / ne) * m["C"] @ q))
        check(f"‖f_E − f̂_E‖ bound ({trial})", np.linalg.norm(fE - fhat) <= bound + 1e-13)
        # exactness cases (§8.9): n = 1, identical evicted keys, q = 0
        one = mk.moments_of(KE[:1], VE[:1])
        o1, l1, _, _ = mk.corrected_row(q, 10 ** 6, KR, VR, pos, one, c, 0.0)
        f1, lf1 = full_attention(q, np.vstack([KR, KE[:1]]), np.vstack([VR, VE[:1]]), c)
        close(f"n = 1: corrected == full attention ({trial})", np.append(o1, l1), np.append(f1, lf1), 1e-12)
        same = mk.moments_of(np.repeat(KE[:1], ne, axis=0), VE)
        os_, ls, _, _ = mk.corrected_row(q, 10 ** 6, KR, VR, pos, same, c, 0.0)
        fs, lfs = full_attention(q, np.vstack([KR, np.repeat(KE[:1], ne, axis=0)]), V, c)
        close(f"identical evicted keys: exact ({trial})", np.append(os_, ls), np.append(fs, lfs), 1e-11)
        o0, l0, _, _ = mk.corrected_row(np.zeros(dk), 10 ** 6, KR, VR, pos, m, c, 0.0)
        f0, lf0 = full_attention(np.zeros(dk), K, V, c)
        close(f"q = 0: exact ({trial})", np.append(o0, l0), np.append(f0, lf0), 1e-12)
        # f̂_E affine in q (§10.15); zeroth order gives v̄ (§10.19)
        q2, a = rng.standard_normal(dk), rng.uniform(-1, 2)
        e1, e2 = mk.evicted_state(q, m, c, 0.0)[0], mk.evicted_state(q2, m, c, 0.0)[0]
        close(f"f̂_E affine ({trial})", mk.evicted_state(a * q + (1 - a) * q2, m, c, 0.0)[0],
              a * e1 + (1 - a) * e2, 1e-12)
        close(f"zeroth order: f̂_E == v̄ ({trial})", mk.evicted_state(q, m, c, 1e-6, "zeroth")[0], m["vm"], 0)
        # n = 0: o_R unchanged (§10.6)
        oz, lz, _, _ = mk.corrected_row(q, 10 ** 6, KR, VR, pos, mk.empty_moments(dk, dv), c)
        close(f"n = 0: out == o_R ({trial})", np.append(oz, lz), np.append(fr, lr), 0)
        # equivariance (§10.16): values + b shifts the output by b; keys + t leaves it unchanged
        bvec, tvec = rng.standard_normal(dv), rng.standard_normal(dk)
        ob, _, _, _ = mk.corrected_row(q, 10 ** 6, KR, VR + bvec, pos, mk.moments_of(KE, VE + bvec), c, 0.0)
        close(f"values + b -> out + b ({trial})", ob, out + bvec, 1e-11)
        ot, _, _, _ = mk.corrected_row(q, 10 ** 6, KR + tvec, VR, pos, mk.moments_of(KE + tvec, VE), c, 0.0)
        close(f"keys + t -> out unchanged ({trial})", ot, out, 1e-11)
    # causal mask of the retained part: a query sees the slots at or before its position
    K, V = rng.standard_normal((6, 4)), rng.standard_normal((6, 3))
    o, l = mk.retained_attention(K[0], 3, K, V, np.arange(6), 0.5)
    f, lf = full_attention(K[0], K[:4], V[:4], 0.5)
    close("causal mask", np.append(o, l), np.append(f, lf), 1e-12)
    o, l = mk.retained_attention(K[0], -1, K, V, np.arange(6), 0.5)
    check("nothing visible: zeros, -inf", not o.any() and l == -np.inf)
    # stability (§10.18): logits near ±1000
    m = mk.moments_of(K[:3] * 0 + 50.0, V[:3])
    for sgn in (1.0, -1.0):
        q = np.full(4, sgn * 40.0)
        out, lse, o_r, lse_r = mk.corrected_row(q, 100, K[3:], V[3:], np.arange(3), m, 0.5, 0.0)
        check(f"stable at logits {sgn * 1000:+.0f}", np.all(np.isfinite(out)) and np.isfinite(lse))
        w_r = math.exp(lse_r - lse)
        check(f"ŵ_R -> {0 if sgn > 0 else 1} at logits {sgn * 1000:+.0f}",
              (w_r < 1e-100) if sgn > 0 else (w_r > 1 - 1e-12), f"{w_r}")
    # GQA == MHA with repeated KV heads (§10.27), through corrected_attention
    B, Hkv, g, N, dk, dv = 1, 2, 3, 12, 4, 5
    K, V = rng.standard_normal((B, Hkv, N, dk)), rng.standard_normal((B, Hkv, N, dv))
    Q = rng.standard_normal((B, Hkv * g, 2, dk))
    kept = [[np.array([0, 3, 5, 9, 11]), np.array([1, 2, 10, 11])]]
    moms = [[mk.moments_of(np.delete(K[0, h], kept[0][h], 0), np.delete(V[0, h], kept[0][h], 0)) for h in range(2)]]
    pos = [[10, 12]]
    gqa = mk.corrected_attention(Q, pos, K, V, kept, moms)
    mha = mk.corrected_attention(Q, pos, np.repeat(K, g, axis=1), np.repeat(V, g, axis=1),
                                 [[kept[0][h // g] for h in range(Hkv * g)]],
                                 [[moms[0][h // g] for h in range(Hkv * g)]])
    for x, y, what in zip(gqa, mha, ("out", "lse", "plain", "plain lse")):
        close(f"GQA == MHA repeated: {what}", x, y, 1e-14)


# ------------------------------------------------------------------------------------------------ base score
def test_base_scores():
    rng = np.random.default_rng(13)
    for B, Hkv, g, N, d, w, ks in ((1, 2, 2, 23, 4, 5, 4), (2, 1, 3, 16, 3, 4, 3), (1, 2, 1, 7, 2, 7, 4),
                                   (1, 1, 2, 9, 3, 2, 1)):
        K = rng.standard_normal((B, Hkv, N, d))
        Q = rng.standard_normal((B, Hkv * g, w, d)) * 2
        got = mk.base_scores(K, Q, ks)
        ref = np.zeros((B, Hkv, N))
        m = N - w
        for b in range(B):
            for h in range(Hkv):
                votes = np.zeros(N)
                for qh in range(h * g, (h + 1) * g):
                    for i in range(w):
                        p = N - w + i
                        logits = [float(Q[b, qh, i] @ K[b, h, j]) / math.sqrt(d) for j in range(p + 1)]
                        z = sum(math.exp(x) for x in logits)
                        for j in range(p + 1):
                            votes[j] += math.exp(logits[j]) / z / g
                for j in range(m):
                    c0 = (j // ks) * ks
                    chunk = votes[c0: min(m, c0 + ks)]
                    ref[b, h, j] = sum(chunk) / len(chunk)
                top = max(ref[b, h, :m]) if m else 0.0
                ref[b, h, m:] = top + 1.0
        close(f"base score == loops (N {N}, w {w}, k {ks}, g {g})", got, ref, 1e-12)


# ---------------------------------------------------------------------------------------------- MI and prefill
def test_mi_scores():
    rng = np.random.default_rng(14)
    K, V = rng.standard_normal((10, 4)), rng.standard_normal((10, 3))
    a = rng.random(10)
    c = 0.5
    close("n = 0: score == α‖v‖", mk.mi_scores(a, K, V, mk.empty_moments(4, 3), c), a * np.linalg.norm(V, axis=1), 0)
    m = mk.moments_of(rng.standard_normal((6, 4)), rng.standard_normal((6, 3)))
    V2 = V.copy()
    V2[4] = m["vm"] + (c / m["n"]) * (mk.clamp(m["C"]) @ K[4])  # the affine prediction: r = 0
    s = mk.mi_scores(a, K, V2, m, c)
    check("r_j = 0 gives score 0", abs(s[4]) < 1e-15, f"{s[4]}")
    kept, _ = mk.top_k(s, 9, 1, 2)
    check("r_j = 0 is evicted first", 4 not in kept)
    r = V - m["vm"] - (c / m["n"]) * K @ mk.clamp(m["C"]).T
    close("score == α ‖v − v̄ − (c/n) C̃ k‖ (uses k, not k − k̄)", mk.mi_scores(a, K, V, m, c),
          a * np.linalg.norm(r, axis=1), 1e-14)
    a2 = a.copy()
    a2[[1, 2]] = [0.0, np.inf]
    s = mk.mi_scores(a2, K, V2 * 0, mk.empty_moments(4, 3), c)  # ‖r‖ = 0 everywhere
    check("α 0 / +inf stay as is", s[1] == 0.0 and s[2] == np.inf and not np.isnan(s).any())
    # top-k: ties to the lower index, protected always kept
    kept, gap = mk.top_k(np.array([5.0, 1, 2, 2, 2, 0, 9]), 4, 1, 1)
    check("top-k ties to the lower index", list(kept) == [0, 2, 3, 6], f"{kept}")
    check("top-k tie gap 0", gap == 0.0)
    kept, _ = mk.top_k(np.array([0.0, 9, 9, 0]), 1, 1, 1)
    check("protected above the budget", list(kept) == [0, 3], f"{kept}")
    check("fixed budget: max(budget, protected), min(n)", (mk.fixed_budget(50, 5, 4, 16), mk.fixed_budget(50, 30, 1, 8),
                                                            mk.fixed_budget(10, 30, 1, 8)) == (20, 30, 10))


def greedy_reference(alpha, K, V, L, n_sink, n_recent, c, tau):
    """Algorithm 1 with a frozen base, literally: while |R| > L evict the unprotected argmin of α‖r‖ (ties: the
    higher index goes, i.e. the lower index is kept), the moments as the paper's raw sums recomputed per step."""
    R = list(range(len(alpha)))
    n, sk, sv, S = 0, np.zeros(K.shape[1]), np.zeros(V.shape[1]), np.zeros((V.shape[1], K.shape[1]))
    order = []
    while len(R) > L:
        best = None
        for pos, j in enumerate(R):
            if pos < n_sink or pos >= len(R) - n_recent:
                continue
            if n == 0:
                r = V[j]
            else:
                Ct = S - np.outer(sv, sk) / n
                Ct = np.where(np.abs(Ct) < tau, 0.0, Ct)
                r = V[j] - sv / n - (c / n) * (Ct @ K[j])
            s = alpha[j] * math.sqrt(float(r @ r))
            if best is None or s <= best[0]:  # '<=': among equal scores the later (higher) index is evicted
                best = (s, j)
        j = best[1]
        R.remove(j)
        order.append(j)
        n, sk, sv, S = n + 1, sk + K[j], sv + V[j], S + np.outer(V[j], K[j])
    return R, order, (n, sk, sv, S)


def test_prefill():
    rng = np.random.default_rng(15)
    shapes = ((30, 4, 4, 10, 1, 4, 1e-6), (25, 3, 5, 12, 2, 3, 0.0), (40, 5, 2, 8, 0, 6, 0.05), (20, 4, 4, 3, 2, 2, 1e-6))
    for trial, (N, dk, dv, budget, n_sink, n_recent, tau) in enumerate(shapes):
        K = rng.standard_normal((N, dk)) + 0.4 * rng.standard_normal(dk)
        V = rng.standard_normal((N, dv))
        alpha = rng.random(N) ** 2
        c = 1 / math.sqrt(dk)
        L = mk.fixed_budget(N, budget, n_sink, n_recent)
        res = mk.prefill_head(alpha, K, V, budget, n_sink, n_recent, N - L, c, tau)
        R, order, (n, sk, sv, S) = greedy_reference(alpha, K, V, L, n_sink, n_recent, c, tau)
        check(f"greedy N − L rounds: kept ({trial})", list(res["kept"]) == R, f"{list(res['kept'])} vs {R}")
        check(f"greedy N − L rounds: eviction order ({trial})",
              [int(x) for _, _, e in res["rounds"] for x in e] == order)
        m = res["moments"]
        check(f"greedy: n ({trial})", m["n"] == n == N - L)
        close(f"greedy: k̄, v̄, S ({trial})", np.concatenate([m["km"], m["vm"], mk.raw_sums(m)[3].ravel()]),
              np.concatenate([sk / n, sv / n, S.ravel()]), 1e-11)
        close(f"greedy: mi_first == α‖v‖ ({trial})", res["mi_first"], alpha * np.linalg.norm(V, axis=1), 0)
        # one round == one-shot top-k of α‖v‖
        one = mk.prefill_head(alpha, K, V, budget, n_sink, n_recent, 1, c, tau)
        ref, _ = mk.top_k(alpha * np.linalg.norm(V, axis=1), L, n_sink, n_recent)
        check(f"1 round == top-k of α‖v‖ ({trial})", list(one["kept"]) == list(ref))
        ev = np.setdiff1d(np.arange(N), ref)
        same_moments(f"1 round: moments of the evicted ({trial})", one["moments"], mk.moments_of(K[ev], V[ev]), 1e-12)
        # R rounds: the schedule evicts ceil((n − L)/left) per round and ends at L; stats = those of the evicted
        for rounds in (2, 3, 8, N):
            res = mk.prefill_head(alpha, K, V, budget, n_sink, n_recent, rounds, c, tau)
            n_left = N
            ok = len(res["kept"]) == L and len(res["rounds"]) == rounds
            for left, (n_r, keep, evicted) in zip(range(rounds, 0, -1), res["rounds"]):
                ok = ok and n_r == n_left and keep == n_left - math.ceil(max(0, n_left - L) / left)
                ok = ok and len(evicted) == n_r - keep
                n_left = keep
            check(f"{rounds} rounds: schedule ({trial})", ok)
            ev = np.setdiff1d(np.arange(N), res["kept"])
            same_moments(f"{rounds} rounds: moments == two-pass of the evicted ({trial})", res["moments"],
                         mk.moments_of(K[ev], V[ev]), 1e-11)
            prot = mk.protected_slots(N, n_sink, n_recent)
            check(f"{rounds} rounds: protected kept ({trial})", set(prot) <= set(res["kept"]))
    # the batched entry point == per-head calls on base_scores
    B, Hkv, g, N, d, w = 2, 2, 2, 40, 4, 6
    K, V = rng.standard_normal((B, Hkv, N, d)), rng.standard_normal((B, Hkv, N, d))
    Q = rng.standard_normal((B, Hkv * g, w, d))
    alpha, res = mk.prefill(K, V, Q, 14, 1, w, 3)
    a2 = mk.base_scores(K, Q, 4)
    close("prefill α == base_scores", alpha, a2, 0)
    for b in range(B):
        for h in range(Hkv):
            r = mk.prefill_head(a2[b, h], K[b, h], V[b, h], 14, 1, w, 3, 1 / math.sqrt(d))
            check(f"prefill == prefill_head ({b}, {h})", list(r["kept"]) == list(res[b][h]["kept"]))


def main():
    test_moments()
    test_correction()
    test_base_scores()
    test_mi_scores()
    test_prefill()
    finish("moment_kv: moments (Welford, raw, Chan), corrected attention (exactness, Jensen, identities, "
           "stability, GQA), base score, MI score, prefill rounds (greedy, one shot, schedule) hold")


if __name__ == "__main__":
    main()
