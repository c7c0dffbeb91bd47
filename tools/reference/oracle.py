# SPDX-License-Identifier: Apache-2.0
"""Independent NumPy oracle for kvc's policies, written from the papers/specs, in float64.

Nothing here imports or mirrors kvc's C++ code: it is the reference the C++ kernels are tested against.
Shapes follow the kvc CLI contract: keys/values [B, Hkv, N, d]; scores [B, Hkv, N], higher = keep.
"""
import numpy as np


def key_diff_scores(keys, anchor="normalized_mean"):
    """KeyDiff, paper Eq. 8 (arXiv 2504.15364): s_i = -cos(mu, k_i), mu = mean of unit keys.

    Unit keys use max(||k||, 1e-12) (F.normalize); the cosine uses max(||mu||, 1e-8) * max(||k||, 1e-8).
    """
    k = np.asarray(keys, dtype=np.float64)
    norms = np.linalg.norm(k, axis=-1, keepdims=True)
    if anchor == "normalized_mean":
        mu = (k / np.maximum(norms, 1e-12)).mean(axis=2, keepdims=True)
    elif anchor == "raw_mean":
        mu = k.mean(axis=2, keepdims=True)
    else:
        raise ValueError(anchor)
    mu_norm = np.linalg.norm(mu, axis=-1)
    dots = (k * mu).sum(axis=-1)
    return -dots / (np.maximum(mu_norm, 1e-8) * np.maximum(norms[..., 0], 1e-8))


def knorm_scores(keys):
    """Knorm (kvpress KnormPress): s_i = -||k_i||_2."""
    return -np.linalg.norm(np.asarray(keys, dtype=np.float64), axis=-1)


def streaming_llm_keep(n, keep, n_sink):
    """StreamingLLM: the first n_sink tokens and the most recent keep - n_sink (paper / kvpress)."""
    keep = min(keep, n)
    sinks = list(range(min(n_sink, keep)))
    recent = list(range(n - (keep - len(sinks)), n)) if keep > len(sinks) else []
    return np.array(sinks + recent, dtype=np.int64)


def ratio_keep(n, ratio):
    """kvpress: kept = int(n * (1 - ratio))."""
    return int(n * (1.0 - ratio))


def top_k(scores_row, keep, n_sink=0, n_recent=0):
    """Kept indices (ascending) of one head: protected windows, then the best by (score desc, index asc)."""
    n = len(scores_row)
    sink_end = min(n_sink, n)
    recent_begin = max(n - n_recent, sink_end)
    protected = list(range(sink_end)) + list(range(recent_begin, n))
    keep = max(min(keep, n), len(protected))
    middle = np.arange(sink_end, recent_begin)
    s = np.where(np.isnan(scores_row[middle]), -np.inf, scores_row[middle])
    order = np.lexsort((middle, -s))  # primary: score descending; ties: lower index
    chosen = middle[order[: keep - len(protected)]]
    return np.sort(np.concatenate([np.array(protected, dtype=np.int64), chosen.astype(np.int64)]))


def attention(q, k, v, scale=None):
    """Softmax attention [B, H, Nq, d] x [B, Hkv, N, d]; query head h reads KV head h // (H // Hkv)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    scale = scale or 1.0 / np.sqrt(q.shape[-1])
    logits = np.einsum("bhqd,bhnd->bhqn", q, k) * scale
    logits -= logits.max(axis=-1, keepdims=True)
    w = np.exp(logits)
    w /= w.sum(axis=-1, keepdims=True)
    return np.einsum("bhqn,bhnd->bhqd", w, v)
