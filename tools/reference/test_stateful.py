# SPDX-License-Identifier: Apache-2.0
"""Self-check of expected_attention.py and h2o.py (the stateful policies' float64 oracle).

Runs both selftests (spec worked examples: expected_attention.md §2.12 and §10.1/3/5, original_baselines.md §1.10),
then property cross-checks: explicit RoPE matrices = baselines.rope, EA invariances (spec §10), and H2O simulate()
against the one-shot accumulator. Run: python3 tools/reference/test_stateful.py (exit 0 = pass, 1 = fail,
77 = NumPy missing).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from selftest import check, failures, finish, require_numpy  # noqa: E402

np = require_numpy()
import baselines as bl  # noqa: E402
import expected_attention as ea  # noqa: E402
import h2o  # noqa: E402

def allclose(name, a, b, tol=1e-12):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    err = np.abs(a - b).max() if a.shape == b.shape and a.size else (0.0 if a.shape == b.shape else np.inf)
    check(name, err <= tol, f"max |diff| {err:.3e} > {tol:.1e} (shapes {a.shape} {b.shape})")


def random_case(rng, B=2, Hkv=2, Hq=4, S=40, d=8, style="neox", theta=10000.0):
    kpre = rng.standard_normal((B, Hkv, S, d)) + 0.3
    keys = bl.rope(kpre, np.arange(S), theta, style)
    values = rng.standard_normal((B, Hkv, S, d))
    queries = 1.5 * (rng.standard_normal((B, Hq, S, d)) + rng.standard_normal((1, Hq, 1, d)))
    return kpre, keys, values, queries


def test_rope_matrices():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 7, 12))
    pos = np.array([0, 1, 5, 17, 100, 511, 4096])
    for style in ("neox", "interleaved"):
        allclose(f"explicit RoPE matrices = baselines.rope ({style})", ea.apply_rope(x, pos, 500.0, style),
                 bl.rope(x, pos, 500.0, style), 1e-12)


def test_ea_properties():
    rng = np.random.default_rng(7)
    kpre, keys, values, queries = random_case(rng)
    B, Hkv, S, d = keys.shape
    Hq = queries.shape[1]
    opts = dict(n_sink=4, T=16, theta=10000.0, style="neox")
    mean, cov = ea.statistics(queries, np.arange(S), 4)
    base, info = ea.scores(keys, values, mean, cov, S, 16, n_sink=4, details=True)
    allclose("prefill() = statistics() + scores()", ea.prefill(keys, values, queries, **opts), base, 0.0)
    # §10.10 softmax normalisation: a-hat sums to 1 per query head, a-bar per KV head
    allclose("a-hat sums to 1", info["probs"].sum(-1), np.ones((B, Hq)), 1e-12)
    allclose("a-bar (mean) sums to 1", info["abar"].sum(-1), np.ones((B, Hkv)), 1e-12)
    # sinks: global max + 1
    check("sinks = global max + 1", np.all(base[..., :4] == base[..., 4:].max() + 1.0))
    # statistics: population covariance of rows [4, S)
    x = queries[1, 3, 4:]
    allclose("statistics = np.cov(bias=True)", cov[1, 3], np.cov(x.T, bias=True), 1e-12)
    # §10.2 use_covariance = False equals Sigma := 0
    allclose("no covariance = Sigma 0", ea.scores(keys, values, mean, cov, S, 16, use_covariance=False),
             ea.scores(keys, values, mean, 0 * cov, S, 16), 0.0)
    # §10.8 covariance monotonicity
    _, i0 = ea.scores(keys, values, mean, cov, S, 16, use_covariance=False, details=True)
    check("covariance raises every logit", np.all(info["lam"] >= i0["lam"] - 1e-15))
    # §10.12 value scaling by c scales non-sink scores by c
    allclose("vnorm scaling", ea.scores(keys, 3.0 * values, mean, cov, S, 16)[..., 4:], 3.0 * base[..., 4:], 1e-12)
    allclose("eps ignored without vnorm", ea.scores(keys, values, mean, cov, S, 16, epsilon=0.5, use_vnorm=False),
             ea.scores(keys, values, mean, cov, S, 16, epsilon=0.0, use_vnorm=False), 0.0)
    # §10.6 RoPE relative invariance: shift key positions and t0 by the same delta
    delta = 37
    keys_shift = bl.rope(kpre, np.arange(S) + delta, 10000.0, "neox")
    allclose("RoPE relative invariance", ea.scores(keys_shift, values, mean, cov, S + delta, 16), base, 1e-10)
    # §10.5 neox vs interleaved give identical scores with consistently permuted Q and K
    perm = np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], axis=1).reshape(-1)  # neox -> interleaved
    keys_il = bl.rope(kpre[..., perm], np.arange(S), 10000.0, "interleaved")
    allclose("neox = interleaved permuted",
             ea.prefill(keys_il, values, queries[..., perm], n_sink=4, T=16, theta=10000.0, style="interleaved"),
             base, 1e-10)
    # §10.11 GQA: duplicating one head's queries G times equals a single-head MHA layer
    q1 = queries[:, ::2]  # [B, Hkv, S, d]: one query head per KV head
    dup = np.repeat(q1, 2, axis=1)
    allclose("GQA duplicated heads = MHA", ea.prefill(keys, values, dup, **opts),
             ea.prefill(keys, values, q1, **opts), 1e-12)
    allclose("GQA max of duplicated heads = MHA", ea.prefill(keys, values, dup, gqa="max", **opts),
             ea.prefill(keys, values, q1, **opts), 1e-12)
    # normalize_sinks: the sinks enter the denominator, so the non-sink a-hat sum to < 1 and the ranking of one
    # query head is unchanged (same logits, one common normaliser)
    _, i_ns = ea.scores(keys, values, mean, cov, S, 16, normalize_sinks=True, details=True)
    check("normalize_sinks: non-sink mass < 1", np.all(i_ns["probs"].sum(-1) < 1.0))
    allclose("normalize_sinks: same ratios within a head",
             i_ns["probs"] / i_ns["probs"].sum(-1, keepdims=True), info["probs"], 1e-12)
    # §10.13 permutation equivariance of non-sink (key, value) pairs
    p = np.concatenate([np.arange(4), 4 + rng.permutation(S - 4)])
    allclose("permutation equivariance", ea.scores(keys[:, :, p], values[:, :, p], mean, cov, S, 16),
             base[:, :, p], 1e-12)
    # §10.14 batch independence (except the sink pad value)
    k2, v2 = keys.copy(), values.copy()
    k2[1], v2[1] = rng.standard_normal(k2[1].shape), rng.standard_normal(v2[1].shape)
    allclose("batch independence", ea.scores(k2, v2, mean, cov, S, 16)[0, :, 4:], base[0, :, 4:], 0.0)
    # S <= n_sink: every slot is a sink, score 1.0
    allclose("S <= n_sink: all ones", ea.scores(keys[:, :, :4], values[:, :, :4], mean, cov, 4, 16),
             np.ones((B, Hkv, 4)), 0.0)
    # no statistics sample: mu = 0, Sigma = 0 -> uniform a-hat, ranking by ||v||
    m0, c0 = ea.statistics(queries[:, :, :4], np.arange(4), 4)
    check("no sample -> zero statistics", not m0.any() and not c0.any())
    s0 = ea.scores(keys, values, m0, c0, S, 16, epsilon=0.0)
    allclose("no sample -> (1/(S-n_s)) ||v||", s0[..., 4:], np.linalg.norm(values, axis=-1)[..., 4:] / (S - 4), 1e-14)
    # decode: a buffer holding the whole prefix from position 0 with next_position = R makes both references agree,
    # and equal prefill
    for ref in ("authors", "kvpress"):
        allclose(f"decode({ref}) on the full prefix = prefill",
                 ea.decode(keys, values, queries, np.arange(S), S, ref, **opts), base, 1e-12)
    # decode with a tail buffer: authors keeps every row past the sinks and t0 = next position; kvpress drops the
    # first n_sink buffer rows and uses t0 = R
    R = 12
    buf, pos = queries[:, :, S - R:], np.arange(S - R, S)
    m_a, c_a = ea.statistics(buf, pos, 4)
    allclose("decode authors", ea.decode(keys, values, buf, pos, S, "authors", **opts),
             ea.scores(keys, values, m_a, c_a, S, 16), 0.0)
    m_k, c_k = ea.statistics(buf[:, :, 4:], pos[4:], 0)
    allclose("decode kvpress", ea.decode(keys, values, buf, pos, S, "kvpress", **opts),
             ea.scores(keys, values, m_k, c_k, R, 16), 1e-13)


def test_h2o():
    rng = np.random.default_rng(11)
    _, keys, values, queries = random_case(rng, B=2, Hkv=2, Hq=4, S=30, d=8)
    B, Hkv, S, _ = keys.shape
    acc = h2o.accumulated(keys, queries)
    A = h2o.prompt_attention(keys, queries)
    allclose("attention rows sum to 1", A.sum(-1), np.ones(A.shape[:3]), 1e-12)
    allclose("observed = accumulated / (S - j)", h2o.observed_attention_scores(keys, queries),
             acc / (S - np.arange(S)), 1e-12)
    allclose("total accumulated mass = S", acc.sum(-1), np.full((B, Hkv), S), 1e-10)
    # simulate with hh + recent >= S: nothing is ever evicted, the accumulator is the column sums
    for n_prefill in (0, 1, 7, S):
        kept, sc = h2o.simulate(keys, values, queries, n_prefill, 20, 10)
        check(f"simulate keeps everything (n_prefill {n_prefill})",
              np.array_equal(kept, np.broadcast_to(np.arange(S), (B, Hkv, S))), f"got {kept[0, 0].tolist()}")
        allclose(f"simulate accumulator = accumulated() (n_prefill {n_prefill})", sc, acc, 1e-12)
    # n_prefill = S: one-shot prefill = prefill_keep of the column sums
    kept, sc = h2o.simulate(keys, values, queries, S, 5, 4)
    want = np.array([[h2o.prefill_keep(acc[b, h], 5, 4) for h in range(Hkv)] for b in range(B)])
    check("one-shot simulate = prefill_keep", np.array_equal(kept, want))
    allclose("one-shot simulate scores", sc, np.take_along_axis(acc, want, -1), 0.0)
    # invariants of the token-by-token path
    kept, sc = h2o.simulate(keys, values, queries, 10, 5, 4)
    check("decode: cache size hh + recent", kept.shape == (B, Hkv, 9))
    check("decode: ascending positions", np.all(np.diff(kept, axis=-1) > 0))
    check("decode: last `recent` tokens present", np.all(kept[..., -4:] == np.arange(S - 4, S)))
    # GQA extension with g = 1 is the identity (per-query-head scores)
    acc1 = h2o.accumulated(keys, queries[:, ::2])
    allclose("GQA g = 1 identity", acc1, A[:, ::2].sum(axis=2), 1e-12)


def main():
    ok_ea = ea.selftest()
    ok_h2o = h2o.selftest()
    if not ok_ea:
        failures.append("expected_attention.selftest() failed (see above)")
    if not ok_h2o:
        failures.append("h2o.selftest() failed (see above)")
    test_rope_matrices()
    test_ea_properties()
    test_h2o()
    finish("stateful oracle: selftests and cross-checks all pass")


if __name__ == "__main__":
    main()
