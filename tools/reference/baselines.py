# SPDX-License-Identifier: Apache-2.0
"""NumPy float64 oracle for the window-attention policies SnapKV and TOVA, in "authors" and "kvpress" behaviour.

Written from shared/specs/original_baselines.md (sections 0.4, 2, 3) and kvpress_reference.md (2.0, 2.3, 2.4).
Shapes: keys [B, Hkv, N, d] (post-RoPE, key j at position j); queries [B, Hq, w, d] PRE-RoPE, window row i at
position N - w + i; query head h reads KV head h // (Hq // Hkv). Scores are [B, Hkv, N], higher = keep; the
protection of the window (SnapKV) or of the last token (TOVA kvpress) is folded into the scores as max + 1.
"""
import numpy as np

SNAP_KV_DEFAULTS = {"authors": (32, 7, "max"), "kvpress": (64, 5, "avg")}  # window, kernel, pooling


def rope(x, positions, theta=10000.0, style="neox"):
    """Rotates x [..., n, d] to `positions` [n]: pair (a, b) turns by angle p * theta^(-2i/d), i < d/2.

    style "neox" (HF rotate-half) pairs (a, b) = (i, i + d/2); "interleaved" (llama.cpp normal) pairs (2i, 2i + 1).
    x_a' = x_a cos - x_b sin,  x_b' = x_b cos + x_a sin.
    """
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    inv_freq = theta ** (-2.0 * np.arange(d // 2) / d)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # [n, d/2]
    cos, sin = np.cos(ang), np.sin(ang)
    if style == "neox":
        a, b = np.arange(d // 2), np.arange(d // 2) + d // 2
    elif style == "interleaved":
        a, b = np.arange(0, d, 2), np.arange(1, d, 2)
    else:
        raise ValueError(f"unknown rope style {style!r}")
    out = np.empty_like(x)
    out[..., a] = x[..., a] * cos - x[..., b] * sin
    out[..., b] = x[..., b] * cos + x[..., a] * sin
    return out


def causal_softmax(logits, positions=None):
    """Softmax over keys of logits [..., w, N], key j visible to row i iff j <= positions[i].

    positions defaults to the window at the end of the prompt, N - w + i. Masked entries are ignored (any value).
    """
    logits = np.asarray(logits, dtype=np.float64)
    w, n = logits.shape[-2:]
    if positions is None:
        positions = n - w + np.arange(w)
    visible = np.arange(n)[None, :] <= np.asarray(positions)[:, None]  # [w, N]
    z = np.where(visible, logits, -np.inf)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def window_logits(queries, keys, positions=None, theta=10000.0, style="neox"):
    """Scaled logits [B, Hq, w, N] = rope(q_i, position_i) . k_j / sqrt(d), unmasked; GQA by repeating KV heads."""
    q = np.asarray(queries, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    w, n, d = q.shape[2], k.shape[2], q.shape[-1]
    if positions is None:
        positions = n - w + np.arange(w)
    g = q.shape[1] // k.shape[1]
    if g * k.shape[1] != q.shape[1]:
        raise ValueError("query heads must be a multiple of KV heads")
    qr = rope(q, positions, theta, style)
    return np.einsum("bhid,bhjd->bhij", qr, np.repeat(k, g, axis=1)) / np.sqrt(d)


def window_attention(queries, keys, positions=None, theta=10000.0, style="neox"):
    """Attention probabilities P [B, Hq, w, N] of the window queries over all N keys, causally masked."""
    w, n = np.shape(queries)[2], np.shape(keys)[2]
    if positions is None:
        positions = n - w + np.arange(w)
    return causal_softmax(window_logits(queries, keys, positions, theta, style), positions)


def pool1d(x, kernel_size, pooling):
    """Pooling along the last axis, stride 1, padding k//2, output length = input length (torch *_pool1d).

    "max" pads with -inf; "avg" pads with zeros and always divides by k (count_include_pad).
    """
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError("kernel_size must be odd and positive")
    if pooling not in ("max", "avg"):
        raise ValueError(f"unknown pooling {pooling!r}")
    x = np.asarray(x, dtype=np.float64)
    if x.shape[-1] == 0:
        return x.copy()
    r = kernel_size // 2
    fill = -np.inf if pooling == "max" else 0.0
    pad = [(0, 0)] * (x.ndim - 1) + [(r, r)]
    win = np.lib.stride_tricks.sliding_window_view(np.pad(x, pad, constant_values=fill), kernel_size, axis=-1)
    return win.max(axis=-1) if pooling == "max" else win.sum(axis=-1) / kernel_size


def reduce_group(x, n_kv_heads, gqa):
    """[B, Hq, ...] -> [B, Hkv, ...]: reduce the g = Hq/Hkv consecutive query heads of each KV head.

    gqa: "mean" | "max" | "sum"; "per_query_head" is the identity and only allowed when g == 1.
    """
    b, hq = x.shape[:2]
    g = hq // n_kv_heads
    grouped = x.reshape((b, n_kv_heads, g) + x.shape[2:])
    if gqa == "per_query_head":
        if g != 1:
            raise ValueError("gqa=per_query_head needs one query head per KV head (g == 1)")
        return grouped[:, :, 0]
    ops = {"mean": np.mean, "max": np.max, "sum": np.sum}
    if gqa not in ops:
        raise ValueError(f"unknown gqa reduction {gqa!r}")
    return ops[gqa](grouped, axis=2)


def protect_tail(prefix_scores, n_tail):
    """Appends n_tail scores of max(prefix) + 1 (max of an empty prefix taken as 0) along the last axis."""
    if prefix_scores.shape[-1]:
        top = prefix_scores.max(axis=-1, keepdims=True)
    else:
        top = np.zeros(prefix_scores.shape[:-1] + (1,))
    return np.concatenate([prefix_scores, np.repeat(top + 1.0, n_tail, axis=-1)], axis=-1)


def snap_kv_from_logits(logits, n_kv_heads, kernel_size, pooling, gqa="mean", reference="authors"):
    """SnapKV scores [B, Hkv, N] from the window's scaled logits [B, Hq, w, N] (masked entries are ignored).

    authors: vote = SUM over the w rows of P on prefix keys [0, N-w); reduce the group (gqa), then pool.
    kvpress: vote = MEAN over the w rows; pool each query head, then reduce the group (gqa; kvpress uses mean).
    Window keys [N-w, N) score max(pooled prefix) + 1.
    """
    p = causal_softmax(logits)
    w, n = p.shape[-2:]
    prefix = p[..., : n - w]  # [B, Hq, w, N-w]
    if reference == "authors":
        pooled = pool1d(reduce_group(prefix.sum(axis=2), n_kv_heads, gqa), kernel_size, pooling)
    elif reference == "kvpress":
        pooled = reduce_group(pool1d(prefix.mean(axis=2), kernel_size, pooling), n_kv_heads, gqa)
    else:
        raise ValueError(f"unknown reference {reference!r}")
    return protect_tail(pooled, w)


def snap_kv_scores(keys, queries, window_size=None, kernel_size=None, pooling=None, gqa="mean",
                   reference="authors", theta=10000.0, style="neox"):
    """SnapKV scores [B, Hkv, N]; the last `window_size` rows of the pre-RoPE `queries` form the window.

    None parameters take the reference's defaults: authors w=32, k=7, max; kvpress w=64, k=5, avg.
    """
    dw, dk, dp = SNAP_KV_DEFAULTS[reference]
    w = dw if window_size is None else window_size
    q = np.asarray(queries)
    n = np.shape(keys)[2]
    if not 1 <= w <= min(q.shape[2], n):
        raise ValueError(f"window_size {w} needs 1 <= w <= min(query rows {q.shape[2]}, N {n})")
    logits = window_logits(q[:, :, q.shape[2] - w:], keys, None, theta, style)
    return snap_kv_from_logits(logits, np.shape(keys)[1], dk if kernel_size is None else kernel_size,
                               dp if pooling is None else pooling, gqa, reference)


def tova_from_logits(last_logits, n_kv_heads, reference="authors"):
    """TOVA scores [B, Hkv, N] from the last query's scaled logits [B, Hq, N] over all N keys (itself included).

    s_j = mean over ALL Hq heads of softmax_j; every KV head gets the same s. authors: s as is (the last token can
    lose); kvpress: s_{N-1} = max(s_0..s_{N-2}) + 1.
    """
    a = causal_softmax(np.asarray(last_logits, dtype=np.float64)[..., None, :])[..., 0, :]  # [B, Hq, N]
    s = a.mean(axis=1, keepdims=True)  # [B, 1, N]
    if reference == "kvpress":
        s = protect_tail(s[..., :-1], 1)
    elif reference != "authors":
        raise ValueError(f"unknown reference {reference!r}")
    return np.repeat(s, n_kv_heads, axis=1)


def tova_scores(keys, queries, reference="authors", theta=10000.0, style="neox"):
    """TOVA scores [B, Hkv, N] from the LAST row of the pre-RoPE `queries` [B, Hq, w, d] (position N - 1)."""
    q = np.asarray(queries)[:, :, -1:]
    logits = window_logits(q, keys, None, theta, style)[:, :, 0]
    return tova_from_logits(logits, np.shape(keys)[1], reference)
