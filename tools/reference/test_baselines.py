# SPDX-License-Identifier: Apache-2.0
"""Self-check of baselines.py against the worked examples of shared/specs/original_baselines.md §2.6 and §3.5.

Printed numbers must match to their 4 decimals (|x - printed| <= 5e-5); kept sets exactly. Also checks RoPE
identities. Run: python3 tools/reference/test_baselines.py (exit 0 = pass). Exit 77 when NumPy is missing.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from selftest import check, finish, require_numpy  # noqa: E402

np = require_numpy()
import baselines as bl  # noqa: E402
import oracle  # noqa: E402

def close4(name, actual, printed):
    actual, printed = np.asarray(actual, dtype=np.float64), np.asarray(printed, dtype=np.float64)
    check(name, actual.shape == printed.shape and np.all(np.abs(actual - printed) <= 5e-5 + 1e-12),
          f"got {np.round(actual, 5).tolist()}, expected {printed.tolist()}")


def kept(name, scores_row, keep, expected):
    got = oracle.top_k(scores_row, keep).tolist()
    check(name, got == sorted(expected), f"got {got}, expected {sorted(expected)}")


def test_snap_kv():
    """§2.6: N = 10, w = 2, k = 3, C = 6, H = 2 query heads on 1 KV head. NaN marks the masked entry."""
    nan = np.nan
    logits = np.array([[[[2, 0, 0, 1, 3, 0, 0, 0, 1, nan], [2, 0, 0, 0, 3, 1, 0, 0, 1, 1]],
                        [[1, 0, 0, 0, 0, 0, 3, 2, 0, nan], [1, 0, 0, 0, 0, 0, 2, 3, 0, 1]]]], dtype=np.float64)
    votes = [[0.3768, 0.0510, 0.0510, 0.0963, 1.0242, 0.0933, 0.0510, 0.0510],
             [0.1450, 0.0533, 0.0533, 0.0533, 0.0533, 0.0533, 0.7449, 0.7203]]
    avg = [[0.1426, 0.1596, 0.0661, 0.3905, 0.4046, 0.3895, 0.0651, 0.0340],
           [0.0661, 0.0839, 0.0533, 0.0533, 0.0533, 0.2838, 0.5062, 0.4884]]
    avg_kept = [[1, 3, 4, 5], [1, 5, 6, 7]]
    mx = [[0.3768, 0.3768, 0.0963, 1.0242, 1.0242, 1.0242, 0.0933, 0.0510],
          [0.1450, 0.1450, 0.0533, 0.0533, 0.0533, 0.7449, 0.7449, 0.7449]]
    mx_kept = [[0, 3, 4, 5], [0, 5, 6, 7]]
    for h in range(2):  # authors, per query head: each query head alone is an MHA head (g = 1)
        one = logits[:, h:h + 1]
        close4(f"snap_kv vote head{h}", bl.snap_kv_from_logits(one, 1, 1, "avg", "per_query_head")[0, 0, :8],
               votes[h])
        s = bl.snap_kv_from_logits(one, 1, 3, "avg", "per_query_head")[0, 0]
        close4(f"snap_kv avgpool head{h}", s[:8], avg[h])
        close4(f"snap_kv window = max + 1, head{h}", s[8:], [max(avg[h]) + 1] * 2)
        kept(f"snap_kv avgpool kept head{h}", s, 6, avg_kept[h] + [8, 9])
        s = bl.snap_kv_from_logits(one, 1, 3, "max", "per_query_head")[0, 0]
        close4(f"snap_kv maxpool head{h}", s[:8], mx[h])
        kept(f"snap_kv maxpool kept head{h}", s, 6, mx_kept[h] + [8, 9])
    kvp = bl.snap_kv_from_logits(logits, 1, 3, "avg", "mean", "kvpress")[0, 0]
    close4("snap_kv kvpress", kvp[:8], [0.0522, 0.0609, 0.0299, 0.1110, 0.1145, 0.1683, 0.1428, 0.1306])
    kept("snap_kv kvpress kept", kvp, 6, [4, 5, 6, 7, 8, 9])
    # avgpool and the mean are linear, so authors (sum, reduce, pool) = w * kvpress (mean, pool, reduce) (§2.4.3)
    auth = bl.snap_kv_from_logits(logits, 1, 3, "avg", "mean", "authors")[0, 0]
    check("snap_kv authors avg/mean = w * kvpress", np.allclose(auth[:8], 2 * kvp[:8], rtol=0, atol=1e-12))
    try:
        bl.snap_kv_from_logits(logits, 1, 3, "max", "per_query_head")
        check("per_query_head with g = 2 must raise", False)
    except ValueError:
        pass


def test_tova():
    """§3.5: N = 8, M = 5, H = 2 query heads on 1 KV head; logits of the last prompt token (position 7)."""
    logits = np.array([[[3, 0, 1, 0, 2, 0, 0, 0.5], [2, 1, 0, 0, 0, 2, 0.8, 0]]], dtype=np.float64)
    probs = [[0.5604, 0.0279, 0.0758, 0.0279, 0.2062, 0.0279, 0.0279, 0.0460],
             [0.3115, 0.1146, 0.0422, 0.0422, 0.0422, 0.3115, 0.0938, 0.0422]]
    for h in range(2):
        close4(f"tova probs head{h}", bl.tova_from_logits(logits[:, h:h + 1], 1)[0, 0], probs[h])
    s = bl.tova_from_logits(logits, 1, "authors")[0, 0]
    close4("tova head mean", s, [0.4359, 0.0712, 0.0590, 0.0350, 0.1242, 0.1697, 0.0609, 0.0441])
    kept("tova authors kept (M = 5)", s, 5, [0, 1, 4, 5, 6])
    s = bl.tova_from_logits(logits, 1, "kvpress")[0, 0]
    check("tova kvpress last = max + 1", abs(s[7] - (0.4359 + 1)) <= 5e-5, f"got {s[7]}")
    kept("tova kvpress kept (r = 3/8)", s, oracle.ratio_keep(8, 3 / 8), [0, 1, 4, 5, 7])
    # decode token 8 over the cache [0, 1, 4, 5, 6, 8]: the new token itself is evicted
    dec = np.array([[[2, 1, 0, 1, 0.5, -1], [1, 2, 0, 0, 1, -1]]], dtype=np.float64)
    s = bl.tova_from_logits(dec, 1, "authors")[0, 0]
    close4("tova decode head mean", s, [0.3227, 0.3290, 0.0645, 0.1187, 0.1415, 0.0237])
    kept("tova decode kept", s, 5, [0, 1, 2, 3, 4])
    # GQA: all KV heads get the same scores
    s = bl.tova_from_logits(logits, 2)
    check("tova broadcast to KV heads", s.shape == (1, 2, 8) and np.array_equal(s[:, 0], s[:, 1]))


def test_rope():
    """Rotation: norm-preserving, identity at 0, relative (q(p).k(p') depends on p - p'), styles agree up to layout."""
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((2, 5, 16))
    pos = np.array([0, 3, 7, 100, 4095])
    for style in ("neox", "interleaved"):
        r = bl.rope(x, pos, 10000.0, style)
        check(f"rope {style} norm", np.allclose(np.linalg.norm(r, axis=-1), np.linalg.norm(x, axis=-1)))
        check(f"rope {style} identity at 0", np.allclose(r[0], x[0]))
        a = (bl.rope(x, pos + 11, 10000.0, style) * bl.rope(y, pos + 2, 10000.0, style)).sum(-1)
        b = (bl.rope(x, np.full(5, 9), 10000.0, style) * y).sum(-1)
        check(f"rope {style} relative", np.allclose(a, b))
    perm = np.stack([np.arange(8), np.arange(8) + 8], axis=1).reshape(-1)  # neox layout -> interleaved layout
    check("rope neox = interleaved permuted",
          np.allclose(bl.rope(x, pos, 500.0, "neox")[:, perm], bl.rope(x[:, perm], pos, 500.0, "interleaved")))


def main():
    test_snap_kv()
    test_tova()
    test_rope()
    finish("baselines: all worked examples match (SnapKV §2.6, TOVA §3.5) and RoPE identities hold")


if __name__ == "__main__":
    main()
