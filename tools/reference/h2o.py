# SPDX-License-Identifier: Apache-2.0
"""NumPy float64 oracle for H2O (Heavy-Hitter Oracle) and kvpress ObservedAttentionPress.

Written from shared/specs/original_baselines.md §1 (variant (a), "real drop", worked example §1.10) and
kvpress_reference.md §2.6. Independent of kvc's C++ code.

Shapes and conventions:
  keys      [B, Hkv, S, d]   POST-RoPE, key j at absolute position j.
  values    [B, Hkv, S, dv]  (not used by the scores; H2O gathers them with the keys).
  queries   [B, Hq, S, d]    PRE-RoPE, row i at position i; RoPE'd here with baselines.rope (theta, style).
  GQA       query head h reads KV head h // (Hq // Hkv). Attention is a float64 softmax with scale 1/sqrt(d).
  The original H2O is MHA-only (§1.6); the library's GQA extension reduces the g query heads of a KV head by the
  MEAN: of the per-query-head column sums at prefill, of the per-query-head attention rows at each decode step
  (the mean is linear, so both paths agree). With g = 1 it is the identity.
  Every (b, kv head) keeps its own token set and accumulator; nothing is summed over the batch (the authors sum
  over the batch, B = 1 in practice).
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402  (rope, causal_softmax: the shared oracle helpers)


def prompt_attention(keys, queries, theta=10000.0, style="neox"):
    """Causal attention probabilities A [B, Hq, S, S] of the S prompt queries (row i at position i) over the S keys."""
    k = np.asarray(keys, dtype=np.float64)
    q = np.asarray(queries, dtype=np.float64)
    S = k.shape[2]
    if q.shape[2] != S:
        raise ValueError(f"need one query row per key: {q.shape[2]} rows, {S} keys")
    logits = baselines.window_logits(q, k, np.arange(S), theta, style)
    return baselines.causal_softmax(logits, np.arange(S))


def _group_mean(x, n_kv_heads):
    """[B, Hq, ...] -> [B, Hkv, ...]: mean over the g consecutive query heads of each KV head."""
    b, hq = x.shape[:2]
    return x.reshape((b, n_kv_heads, hq // n_kv_heads) + x.shape[2:]).mean(axis=2)


# ------------------------------------------------------------------------------------- one-shot prefill scores
def observed_from_attention(A, n_kv_heads):
    """kvpress ObservedAttentionPress from causal attention A [B, Hq, S, S]: column sums / (S - j), group mean."""
    A = np.asarray(A, dtype=np.float64)
    S = A.shape[-1]
    return _group_mean(A.sum(axis=2) / (S - np.arange(S)), n_kv_heads)


def accumulated_from_attention(A, n_kv_heads):
    """H2O's raw column sums of causal attention A [B, Hq, S, S], group mean -> [B, Hkv, S]."""
    return _group_mean(np.asarray(A, dtype=np.float64).sum(axis=2), n_kv_heads)


def observed_attention_scores(keys_postrope, queries_prerope, theta=10000.0, style="neox"):
    """kvpress ObservedAttentionPress scores [B, Hkv, S]: S_j = sum_i A(i, j) / (S - j), mean over the group."""
    return observed_from_attention(prompt_attention(keys_postrope, queries_prerope, theta, style),
                                   np.shape(keys_postrope)[1])


def accumulated(keys, queries, theta=10000.0, style="neox"):
    """H2O's prefill accumulator [B, Hkv, S]: raw column sums of the causal prompt attention, group mean."""
    return accumulated_from_attention(prompt_attention(keys, queries, theta, style), np.shape(keys)[1])


# ------------------------------------------------------------------------------------------------------ eviction
def prefill_keep(acc_row, hh, recent):
    """H2O keep rule (§1.2 step 3) on one row of n scores: the top-hh over the candidates [0, n - recent) (ties: the
    lower index), ascending, followed by the last `recent` slots. Returns indices [min(n, hh + recent)]; when
    n <= hh + recent nothing is evicted (all n indices)."""
    acc_row = np.asarray(acc_row, dtype=np.float64)
    n = len(acc_row)
    if n <= hh + recent:
        return np.arange(n, dtype=np.int64)
    cand = n - recent
    order = np.lexsort((np.arange(cand), -acc_row[:cand]))  # score descending, ties: lower index
    heavy = np.sort(order[:hh])
    return np.concatenate([heavy, np.arange(cand, n)]).astype(np.int64)


class HeadState:
    """H2O variant (a) state of one (b, kv head): cached absolute positions (ascending) and their accumulated
    scores. Attention rows are supplied already reduced over the GQA group."""

    def __init__(self, hh, recent):
        self.hh, self.recent = int(hh), int(recent)
        self.positions = np.zeros(0, dtype=np.int64)
        self.scores = np.zeros(0)
        self.min_gap = np.inf  # smallest score gap seen between an evicted and a kept candidate (near-tie report)

    def _evict(self):
        n = len(self.positions)
        if n <= self.hh + self.recent:
            return
        keep = prefill_keep(self.scores, self.hh, self.recent)
        cand = n - self.recent
        dropped = np.setdiff1d(np.arange(cand), keep[: self.hh])
        if self.hh and len(dropped):
            self.min_gap = min(self.min_gap, self.scores[keep[: self.hh]].min() - self.scores[dropped].max())
        self.positions, self.scores = self.positions[keep], self.scores[keep]

    def prefill(self, col_sums, positions=None):
        """One-shot prompt: the cache becomes the prompt tokens with their column sums, then evicts to hh + recent."""
        col_sums = np.asarray(col_sums, dtype=np.float64)
        self.positions = np.arange(len(col_sums), dtype=np.int64) if positions is None else np.asarray(positions)
        self.scores = col_sums.copy()
        self._evict()

    def step(self, position, row):
        """One decode token: append it, add its attention row (over [cache..., itself]) to the scores, evict."""
        row = np.asarray(row, dtype=np.float64)
        if len(row) != len(self.positions) + 1:
            raise ValueError(f"attention row has {len(row)} entries for {len(self.positions)} cached + 1 new")
        self.positions = np.append(self.positions, position)
        self.scores = np.append(self.scores, 0.0) + row
        self._evict()


def simulate(keys, values, queries, n_prefill, hh, recent, theta=10000.0, style="neox", stats=None):
    """H2O variant (a) (§1.2/§1.4), per (b, kv head) independently.

    Tokens [0, n_prefill) form the prompt: one forward, scores = group-mean column sums of its causal attention,
    evicted to hh + recent when longer. Tokens t = n_prefill .. S-1 then arrive one at a time: key t is appended,
    query t (RoPE'd at position t) attends over the cached keys (post-RoPE, absolute positions with holes) and
    itself, the group mean of that row is added to the cached scores, and the cache evicts back to hh + recent.
    Returns (kept positions [B, Hkv, m] int64 ascending, accumulated scores [B, Hkv, m] float64),
    m = min(S, hh + recent). `stats` (a dict), if given, receives "min_gap": the smallest score gap seen at any
    eviction between the lowest kept heavy hitter and the highest evicted candidate (0 = a tie)."""
    del values  # evicted together with the keys; the scores never read them
    k = np.asarray(keys, dtype=np.float64)
    q = np.asarray(queries, dtype=np.float64)
    B, Hkv, S, d = k.shape
    Hq = q.shape[1]
    G = Hq // Hkv
    if G * Hkv != Hq or q.shape[2] != S:
        raise ValueError(f"queries {q.shape} do not match keys {k.shape}")
    if not 0 <= n_prefill <= S:
        raise ValueError(f"n_prefill {n_prefill} outside [0, {S}]")
    states = [[HeadState(hh, recent) for _ in range(Hkv)] for _ in range(B)]
    if n_prefill:
        acc = accumulated(k[:, :, :n_prefill], q[:, :, :n_prefill], theta, style)
        for b in range(B):
            for h in range(Hkv):
                states[b][h].prefill(acc[b, h])
    qr = baselines.rope(q, np.arange(S), theta, style)  # query t at position t
    for t in range(n_prefill, S):
        for b in range(B):
            for h in range(Hkv):
                st = states[b][h]
                cached = np.append(st.positions, t)
                logits = qr[b, h * G:(h + 1) * G, t] @ k[b, h, cached].T / np.sqrt(d)  # [G, n + 1]
                logits -= logits.max(axis=-1, keepdims=True)
                p = np.exp(logits)
                p /= p.sum(axis=-1, keepdims=True)
                st.step(t, p.mean(axis=0))
    kept = np.array([[st.positions for st in row] for row in states], dtype=np.int64)
    acc_out = np.array([[st.scores for st in row] for row in states], dtype=np.float64)
    if stats is not None:
        stats["min_gap"] = min(st.min_gap for row in states for st in row)
    return kept, acc_out


# ------------------------------------------------------------------------------------------------------ selftest
def selftest(verbose=True):
    """Worked example §1.10 exactly (attention rows given directly). True when all pass."""
    fails = []

    def close(name, got, want, tol=1e-12):
        got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
        if not (got.shape == want.shape and np.all(np.abs(got - want) <= tol)):
            fails.append(f"{name}: got {np.round(got, 6).tolist()}, expected {want.tolist()}")

    def same(name, got, want):
        if list(np.asarray(got).tolist()) != list(want):
            fails.append(f"{name}: got {list(np.asarray(got).tolist())}, expected {list(want)}")

    rows = [[1], [0.6, 0.4], [0.5, 0.2, 0.3], [0.4, 0.1, 0.3, 0.2], [0.3, 0.1, 0.2, 0.1, 0.3],
            [0.3, 0.05, 0.25, 0.1, 0.25, 0.05]]
    A = np.zeros((1, 1, 6, 6))
    for i, r in enumerate(rows):
        A[0, 0, i, :len(r)] = r
    acc = accumulated_from_attention(A, 1)[0, 0]
    close("1.10 column sums", acc, [3.1, 0.85, 1.05, 0.4, 0.55, 0.05])
    same("1.10 prefill_keep", prefill_keep(acc, 2, 2), [0, 2, 4, 5])
    st = HeadState(2, 2)
    st.prefill(acc)
    same("1.10 prefill cache", st.positions, [0, 2, 4, 5])
    close("1.10 prefill S", st.scores, [3.1, 1.05, 0.55, 0.05])
    obs = observed_from_attention(A, 1)[0, 0]
    close("1.10 kvpress normalized", obs, [0.5167, 0.17, 0.2625, 0.1333, 0.275, 0.05], 5e-5)
    keep = int(6 * (1 - 1 / 3))
    order = np.lexsort((np.arange(6), -obs))
    same("1.10 kvpress keep count at r = 1/3", [keep], [4])
    same("1.10 kvpress kept", sorted(order[:keep].tolist()), [0, 1, 2, 4])
    # decode token 6: row over [0, 2, 4, 5, 6]
    st.step(6, [0.3, 0.05, 0.05, 0.5, 0.1])
    same("1.10 decode 6 cache", st.positions, [0, 2, 5, 6])
    close("1.10 decode 6 S", st.scores, [3.4, 1.1, 0.55, 0.1])
    # decode token 7: row over [0, 2, 5, 6, 7]
    st.step(7, [0.2, 0.04, 0.61, 0.1, 0.05])
    same("1.10 decode 7 cache", st.positions, [0, 5, 6, 7])
    close("1.10 decode 7 S", st.scores, [3.6, 1.16, 0.2, 0.05])
    # the pre-eviction accumulator of step 7 as printed in the spec: [3.6, 1.14, 1.16, 0.2, 0.05]
    st2 = HeadState(10, 10)
    st2.prefill([3.4, 1.1, 0.55, 0.1], positions=[0, 2, 5, 6])
    st2.step(7, [0.2, 0.04, 0.61, 0.1, 0.05])
    close("1.10 decode 7 S before eviction", st2.scores, [3.6, 1.14, 1.16, 0.2, 0.05])
    # hh = 0: a pure sliding window of `recent`
    st3 = HeadState(0, 3)
    st3.prefill(acc)
    same("hh = 0 sliding window", st3.positions, [3, 4, 5])

    if verbose:
        for f in fails:
            print("FAIL " + f)
        if not fails:
            print("h2o selftest: worked example §1.10 (column sums, prefill cache [0,2,4,5], kvpress normalized "
                  "scores and kept {0,1,2,4} at r = 1/3, decode 6 -> [0,2,5,6], decode 7 -> [0,5,6,7] with S) "
                  "all pass")
    return not fails


if __name__ == "__main__":
    sys.exit(0 if selftest() else 1)
