# SPDX-License-Identifier: Apache-2.0
"""Self-check of allocators.py against shared/specs/original_baselines.md §5.7 (AdaKV worked examples), §6.6
(PyramidKV table), kvpress_reference.md §2.9 (PyramidKVPress example and test grid), and the properties of §5.6 and
§6.5. Integers must match exactly. Run: python3 tools/reference/test_allocators.py (exit 0 = pass). Exit 77 when
NumPy is missing (the random properties use it).
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from selftest import check, finish, require_numpy  # noqa: E402

np = require_numpy()
import allocators as al  # noqa: E402

def equal(name, got, expected):
    check(name, got == expected, f"got {got}, expected {expected}")


EXAMPLE_ONE = [[0.30, 0.25, 0.20, 0.15, 0.12, 0.10, 0.09, 0.08, 0.01, 0.005],
               [0.085, 0.082, 0.02, 0.01, 0.009, 0.008, 0.007, 0.006, 0.004, 0.003]]
EXAMPLE_TWO = [[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.15, 0.001], [0.12] + [0.0001] * 9]


def allocate(rows, keep, alpha, reference, n_sink=0, n_recent=0):
    lengths = [[len(r) for r in rows]]
    return al.ada_kv_allocate([rows], lengths, keep, alpha, reference, n_sink, n_recent)[0]


def test_ada_kv_examples():
    """§5.7: two heads of 10 prefix tokens, B = 5."""
    five = al.fixed_keep(5)
    # example one, alpha = 0.2 (floor(alpha B) = 1): c = (8, 2)
    equal("§5.7 one: c", al.global_winner_counts(EXAMPLE_ONE, [10, 10], 5), [8, 2])
    totals = allocate(EXAMPLE_ONE, five, 0.2, "authors")
    equal("§5.7 one: authors b", totals, [7, 3])
    kept = al.ada_kv_kept([EXAMPLE_ONE], [[10, 10]], [totals])[0]
    equal("§5.7 one: authors head A keeps 0-6", kept[0], list(range(7)))
    equal("§5.7 one: authors head B keeps 0-2", kept[1], list(range(3)))
    equal("§5.7 one: kvpress b", allocate(EXAMPLE_ONE, five, 0.2, "kvpress"), [8, 2])
    # example two, alpha = 0.5 (floor = 2): c = (9, 1), b = (round(6.5), round(2.5)) = (6, 2), sum 8 (not 10)
    equal("§5.7 two: c", al.global_winner_counts(EXAMPLE_TWO, [10, 10], 5), [9, 1])
    equal("§5.7 two: authors b", allocate(EXAMPLE_TWO, five, 0.5, "authors"), [6, 2])
    equal("§5.7 two: kvpress b", allocate(EXAMPLE_TWO, five, 0.5, "kvpress"), [8, 2])
    equal("§0.4 round half to even", [al.round_half_even(x) for x in (6.5, 2.5, 5.5, 3.5, 7.4, 2.6)],
          [6, 2, 6, 4, 7, 3])
    # the same example one with a w = 3 observation window after each head (C = B + w = 8): the window is kept on
    # top of b_h in the authors' behaviour (§5.1 step 6); its scores play no part
    rows = [r + [0.0, 1.0, 0.5] for r in EXAMPLE_ONE]
    totals = allocate(rows, al.fixed_keep(8), 0.2, "authors", 0, 3)
    equal("§5.7 one + window: authors totals", totals, [10, 6])
    kept = al.ada_kv_kept([rows], [[13, 13]], [totals], 0, 3)[0]
    equal("§5.7 one + window: head A", kept[0], list(range(7)) + [10, 11, 12])
    equal("§5.7 one + window: head B", kept[1], [0, 1, 2, 10, 11, 12])
    # §5.1 step 2: B > N - w, no compression (even where the mix would round a token away: alpha 0.5, 9 candidates)
    rows = [[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [0.05] * 10]
    equal("§5.1 step 2: short prompt", allocate(rows, al.fixed_keep(11), 0.5, "authors", 0, 1), [10, 10])


def test_ada_kv_properties():
    """§5.6 on random scores (4 heads of 50 tokens, B = 12), and kvpress's conservation (§5.5.3, §2.10)."""
    rng = np.random.default_rng(5)
    H, N, Bp = 4, 50, 12
    for trial in range(20):
        s = (rng.random((H, N)) * rng.random((H, N))).tolist()
        lengths = [N] * H
        c = al.global_winner_counts(s, lengths, Bp)
        # an independent c_h: NumPy's stable argsort of the flattened scores (sort-then-flatten is a detail)
        flat = np.argsort(-np.array(s).reshape(-1), kind="stable")[: H * Bp]
        equal(f"c_h = global top count ({trial})", c, np.bincount(flat // N, minlength=H).tolist())
        b0 = allocate(s, al.fixed_keep(Bp), 0.0, "authors")
        equal(f"alpha 0: b = c ({trial})", b0, c)
        check(f"alpha 0: sum = H B ({trial})", sum(b0) == H * Bp)
        equal(f"alpha 1: uniform ({trial})", allocate(s, al.fixed_keep(Bp), 1.0, "authors"), [Bp] * H)
        for alpha in (0.2, 0.3, 0.5):
            b = allocate(s, al.fixed_keep(Bp), alpha, "authors")
            check(f"floor holds, alpha {alpha} ({trial})", all(x >= math.floor(alpha * Bp) for x in b), f"{b}")
            scaled = (np.array(s) * 3.5).tolist()
            equal(f"scale invariance, alpha {alpha} ({trial})", allocate(scaled, al.fixed_keep(Bp), alpha, "authors"),
                  b)
            kv = allocate(s, al.fixed_keep(Bp), alpha, "kvpress")
            check(f"kvpress conserves H kept, alpha {alpha} ({trial})", sum(kv) == H * Bp, f"{kv}")
            check(f"kvpress floor, alpha {alpha} ({trial})", all(x >= math.floor(alpha * Bp) for x in kv), f"{kv}")
        # with a window w: every head keeps the whole window, and its kept prefix is its own top-b_h
        w = 5
        totals = allocate(s, al.fixed_keep(Bp + w), 0.2, "authors", 0, w)
        kept = al.ada_kv_kept([s], [lengths], [totals], 0, w)[0]
        for h in range(H):
            check(f"window kept, head {h} ({trial})", set(range(N - w, N)) <= set(kept[h]))
            prefix = [t for t in kept[h] if t < N - w]
            top = sorted(range(N - w), key=lambda t: (-s[h][t], t))[: totals[h] - w]
            equal(f"prefix = own top-b_h, head {h} ({trial})", prefix, sorted(top))


def table_row(name, got, first, last, mean):
    equal(f"{name}: first layers", got[: len(first)], first)
    equal(f"{name}: last layers", got[len(got) - len(last):], last)
    check(f"{name}: mean", abs(sum(got) / len(got) - mean) <= 1e-9, f"got {sum(got) / len(got)}, expected {mean}")


def test_pyramid_examples():
    """§6.6's table (ellipses: the printed ends), and kvpress_reference.md §2.9's example."""
    pa, pk = al.pyramid_authors, al.pyramid_kvpress
    table_row("§6.6 original 8000 C2048 w8", pa(8000, 2048, 8, 20, 32), [3986, 3861, 3736], [236, 111], 2048.5)
    table_row("§6.6 original 8000 C2048 w64", pa(8000, 2048, 64, 20, 32), [3933, 3812], [303, 182], 2057.5)
    equal("§6.6 original 3000 C2048 w8 (uniform)", pa(3000, 2048, 8, 20, 32), [2048] * 32)
    equal("§6.6 original 1500 C2048 w8 (no compression)", pa(1500, 2048, 8, 20, 32), [1500] * 32)
    table_row("§6.6 original 4096 C128 w8", pa(4096, 128, 8, 20, 32), [242, 235, 228], [32, 25], 133.5)
    got = pk(8000, 0.744, 64, 20, 32)
    table_row("§6.6 kvpress 8000 r0.744 w64", got, [3994, 3868, 3743], [228, 102], sum(got) / 32)
    check("§6.6 kvpress 8000: mean 2048", abs(sum(got) / 32 - 2048) <= 2048e-3, f"{sum(got) / 32}")
    got = pk(3000, 1 - 2048 / 3000, 64, 20, 32)
    table_row("§6.6 kvpress 3000 kept 2048 (clamped)", got, [2936, 2879], [1217, 1160], sum(got) / 32)
    check("§6.6 kvpress 3000: mean 2048", abs(sum(got) / 32 - 2048) <= 2048e-3, f"{sum(got) / 32}")
    equal("§6.6 kvpress 4096 kept 128 (fallback, min_n 6.4 < w)", pk(4096, 1 - 128 / 4096, 64, 20, 32), [128] * 32)
    equal("§6.6 original 100 C30 w4 b5 L4", pa(100, 30, 4, 5, 4), [51, 37, 23, 9])
    equal("§6.6 kvpress 100 r0.7 w4 b5 L4", pk(100, 0.7, 4, 5, 4), [54, 38, 22, 6])
    equal("§6.6 original 50 C30 w4 b5 L4 (uniform, N < 2B = 52)", pa(50, 30, 4, 5, 4), [30] * 4)
    equal("§6.6 kvpress 50 r0.4 w4 b5 L4", pk(50, 0.4, 4, 5, 4), [46, 35, 25, 14])
    got = pk(4096, 0.5, 64, 20, 32)
    table_row("§2.9 kvpress 4096 r0.5 w64", got, [3994], [102], 2048)


def test_pyramid_properties():
    """§6.5: monotone, ends, branch boundaries, the mean's excess; kvpress's mean (its own test grid, §2.9)."""
    for n in (300, 1000, 4096, 8000, 20000):
        for C in (64, 128, 256, 1024, 2048):
            for w in (4, 8, 32, 64):
                for beta in (5, 20):
                    for L in (2, 4, 32):
                        if C <= w:
                            continue
                        name = f"authors n{n} C{C} w{w} b{beta} L{L}"
                        got = al.pyramid_authors(n, C, w, beta, L)
                        check(f"{name}: non-increasing", all(x >= y for x, y in zip(got, got[1:])), f"{got}")
                        Bp = C - w
                        if n >= 2 * Bp:
                            mn, mx = Bp // beta, 2 * Bp - Bp // beta
                            if mx >= n - w:
                                mx, mn = n - w, 2 * Bp - (n - w)
                            check(f"{name}: b_0 = max", got[0] - w == mx, f"{got[0] - w} vs {mx}")
                            check(f"{name}: b_L-1 >= min", got[-1] - w >= mn, f"{got[-1] - w} vs {mn}")
                            excess = sum(got) / L - C
                            check(f"{name}: mean excess in [0, (L-1)/2)", 0 <= excess < (L - 1) / 2, f"{excess}")
    # the branch boundaries sit exactly at N = C and N = 2B
    C, w = 100, 8
    Bp = C - w
    equal("boundary N = C - 1: no compression", al.pyramid_authors(C - 1, C, w, 20, 4), [C - 1] * 4)
    equal("boundary N = C: uniform", al.pyramid_authors(C, C, w, 20, 4), [C] * 4)
    equal("boundary N = 2B - 1: uniform", al.pyramid_authors(2 * Bp - 1, C, w, 20, 4), [C] * 4)
    check("boundary N = 2B: pyramid", len(set(al.pyramid_authors(2 * Bp, C, w, 20, 4))) > 1)
    for L in (32, 64, 128):
        for r in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
            for n in (1024, 2787, 4096, 6591, 8192):
                got = al.pyramid_kvpress(n, r, 64, 20, L)
                target = n * (1 - r)
                check(f"kvpress mean n{n} r{r} L{L}", abs(sum(got) / L - target) <= 1e-3 * target,
                      f"{sum(got) / L} vs {target}")
                check(f"kvpress non-increasing n{n} r{r} L{L}", all(x >= y for x, y in zip(got, got[1:])))


def main():
    test_ada_kv_examples()
    test_ada_kv_properties()
    test_pyramid_examples()
    test_pyramid_properties()
    finish("allocators: AdaKV §5.7 examples and §5.6 properties, PyramidKV §6.6 table, §2.9 and §6.5 properties "
          "hold")


if __name__ == "__main__":
    main()
