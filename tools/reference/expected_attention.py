# SPDX-License-Identifier: Apache-2.0
"""NumPy float64 oracle for Expected Attention (EA), written from shared/specs/expected_attention.md (§0-4, §9-10)
and kvpress_reference.md §2.1 / §2.12. Independent of kvc's C++ code.

Shapes and conventions (spec §0):
  keys      [B, Hkv, S, d]   POST-RoPE, key i stored at its absolute position (the caller's business; EA never
                             re-rotates keys, it only uses them as they are).
  values    [B, Hkv, S, dv]
  queries   [B, Hq, N, d]    PRE-RoPE query samples for the statistics (row n at positions[n]).
  mean      [B, Hq, d]       mu, per (batch element, query head), pre-RoPE space.
  cov       [B, Hq, d, d]    Sigma, POPULATION covariance (divide by the number of samples M, spec §2.2 / A3).
  scores    [B, Hkv, S]      float64, higher = keep.
  GQA       query head h reads KV head h // (Hq // Hkv) (HF repeat_kv layout).

RoPE (spec §2.3): R_p acts on pairs (a, b) by angle p * inv_freq[j]:
    (R_p x)_a = cos x_a - sin x_b,   (R_p x)_b = sin x_a + cos x_b
  style "neox" (HF rotate-half): pairs (j, j + r/2), j < r/2, r = rotary_dim (default d);
  style "interleaved" (GPT-J / llama.cpp normal): pairs (2j, 2j + 1), j < r/2.
  inv_freq[j] = theta^(-2j / r) unless given explicitly. Dims >= r are not rotated (identity).

Algorithm (spec §2.2-2.8):
  R-bar   = (1/T) sum_{p = t0 .. t0+T-1} R_p        (brute-force average of T matrices)
  mu-bar  = R-bar mu,  Sigma-bar = R-bar Sigma R-bar^T
  lambda  = s mu-bar.k + (s^2 / 2) k^T Sigma-bar k   (s = 1/sqrt(d) unless given; the quadratic term only when
                                                     use_covariance)
  a-hat   = softmax of lambda over the non-sink slots [n_sink, S) per (b, query head) (over all S slots when
            normalize_sinks: paper Eq. 8's domain; the sinks' own probabilities are then discarded)
  a-bar   = group reduction of a-hat over the G query heads of each KV head: "mean" (kvpress) or "max"
  score   = (a-bar + eps) * ||v||_2 when use_vnorm, else a-bar (eps ignored)
  sinks   = slots [0, n_sink): (global max over every (b, kv head, non-sink slot) score) + 1 (kvpress).
  S <= n_sink: every slot is a sink; all scores are 1.0 (= max of an empty set, taken as 0, plus 1: the same
  convention as baselines.protect_tail).
  No sample for the statistics (M = 0): mu = 0 and Sigma = 0 (spec A3, non-strict mode), i.e. uniform a-hat.

Prefill vs decode (spec §4, A1, A2): see prefill() and decode().
"""
import numpy as np


# ----------------------------------------------------------------------------------------------------------- RoPE
def inv_frequencies(theta, rotary_dim):
    """inv_freq [rotary_dim / 2] = theta^(-2j / rotary_dim)."""
    return float(theta) ** (-2.0 * np.arange(rotary_dim // 2) / rotary_dim)


def rope_pairs(d, style, rotary_dim=None):
    """Index arrays (a, b), each [r/2]: the rotated pairs of a d-dim head for `style`."""
    r = d if rotary_dim is None else rotary_dim
    if r % 2 or r > d or r < 0:
        raise ValueError(f"rotary_dim {r} must be even and <= d {d}")
    if style == "neox":
        return np.arange(r // 2), np.arange(r // 2) + r // 2
    if style == "interleaved":
        return np.arange(0, r, 2), np.arange(1, r, 2)
    raise ValueError(f"unknown rope style {style!r}")


def _inv_freq(theta, d, rotary_dim, inv_freq):
    r = d if rotary_dim is None else rotary_dim
    return np.asarray(inv_freq, dtype=np.float64) if inv_freq is not None else inv_frequencies(theta, r)


def rope_matrix(p, d, theta=10000.0, style="neox", rotary_dim=None, inv_freq=None):
    """The d x d RoPE matrix R_p (identity on the non-rotated dims)."""
    a, b = rope_pairs(d, style, rotary_dim)
    ang = float(p) * _inv_freq(theta, d, rotary_dim, inv_freq)
    R = np.eye(d)
    R[a, a] = np.cos(ang)
    R[a, b] = -np.sin(ang)
    R[b, a] = np.sin(ang)
    R[b, b] = np.cos(ang)
    return R


def rbar(T, t0, theta=10000.0, d=None, style="neox", rotary_dim=None, inv_freq=None):
    """R-bar [d, d] = (1/T) sum_{p = t0}^{t0 + T - 1} R_p, by brute force (spec §2.3). `theta` may be replaced by
    an explicit inv_freq [r/2]."""
    if T < 1:
        raise ValueError("T (n_future_positions) must be >= 1")
    acc = np.zeros((d, d))
    for p in range(int(t0), int(t0) + int(T)):
        acc += rope_matrix(p, d, theta, style, rotary_dim, inv_freq)
    return acc / T


def rbar_closed_form(T, t0, theta=10000.0, d=None, style="neox", rotary_dim=None, inv_freq=None):
    """R-bar from the Dirichlet-kernel closed form of spec §2.3 (used only to check rbar()):
    pair j is rho_j * rotation(psi_j), rho_j = sin(T th_j / 2) / (T sin(th_j / 2)), psi_j = (t0 + (T-1)/2) th_j."""
    a, b = rope_pairs(d, style, rotary_dim)
    th = _inv_freq(theta, d, rotary_dim, inv_freq)
    half = np.sin(th / 2.0)
    rho = np.where(half == 0.0, 1.0, np.sin(T * th / 2.0) / np.where(half == 0.0, 1.0, T * half))
    psi = (t0 + (T - 1) / 2.0) * th
    R = np.eye(d)
    R[a, a] = rho * np.cos(psi)
    R[a, b] = -rho * np.sin(psi)
    R[b, a] = rho * np.sin(psi)
    R[b, b] = rho * np.cos(psi)
    return R


def apply_rope(x, positions, theta=10000.0, style="neox", rotary_dim=None):
    """x [..., n, d] rotated row-wise to positions [n] with explicit matrices (slow, exact)."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    mats = np.stack([rope_matrix(p, d, theta, style, rotary_dim) for p in np.asarray(positions)])  # [n, d, d]
    return np.einsum("nij,...nj->...ni", mats, x)


# ----------------------------------------------------------------------------------------------------- statistics
def statistics(queries_prerope, positions, n_sink, skip_rows=0):
    """mu [B, Hq, d] and population Sigma [B, Hq, d, d] over the rows n with positions[n] >= n_sink and
    n >= skip_rows. positions: [N] (shared) or [B, N]. No selected row: mu = 0, Sigma = 0 (spec A3)."""
    q = np.asarray(queries_prerope, dtype=np.float64)
    B, Hq, N, d = q.shape
    pos = np.asarray(positions)
    pos = np.broadcast_to(pos, (B, N)) if pos.ndim == 1 else pos
    if pos.shape != (B, N):
        raise ValueError(f"positions shape {pos.shape} does not match queries {q.shape}")
    mean = np.zeros((B, Hq, d))
    cov = np.zeros((B, Hq, d, d))
    for b in range(B):
        sel = (pos[b] >= n_sink) & (np.arange(N) >= skip_rows)
        x = q[b][:, sel]  # [Hq, M, d]
        m = x.shape[1]
        if m == 0:
            continue
        mean[b] = x.mean(axis=1)
        c = x - mean[b][:, None, :]
        cov[b] = np.einsum("hmi,hmj->hij", c, c) / m
    return mean, cov


# --------------------------------------------------------------------------------------------------------- scores
def scores(keys_postrope, values, mean, cov, t0, T, theta=10000.0, style="neox", n_sink=4, epsilon=0.01,
           use_covariance=True, use_vnorm=True, gqa="mean", scale=None, normalize_sinks=False, rotary_dim=None,
           inv_freq=None, details=False):
    """EA scores [B, Hkv, S] (float64). details=True also returns a dict with rbar [d,d], mubar [B,Hq,d],
    sigbar [B,Hq,d,d], lam [B,Hq,S] (every slot), probs [B,Hq,S-n_sink] (a-hat of the non-sink slots),
    abar [B,Hkv,S-n_sink], vnorm [B,Hkv,S]."""
    k = np.asarray(keys_postrope, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    B, Hkv, S, d = k.shape
    mean = np.asarray(mean, dtype=np.float64)
    cov = np.asarray(cov, dtype=np.float64)
    Hq = mean.shape[1]
    G = Hq // Hkv
    if G * Hkv != Hq:
        raise ValueError("query heads must be a multiple of KV heads")
    s = 1.0 / np.sqrt(d) if scale is None else float(scale)
    Rb = rbar(T, t0, theta, d, style, rotary_dim, inv_freq)
    mubar = np.einsum("ij,bhj->bhi", Rb, mean)
    sigbar = np.einsum("ij,bhjk,lk->bhil", Rb, cov, Rb)
    kq = np.repeat(k, G, axis=1)  # [B, Hq, S, d]
    lam = s * np.einsum("bhsd,bhd->bhs", kq, mubar)
    if use_covariance:
        lam = lam + 0.5 * s * s * np.einsum("bhsd,bhde,bhse->bhs", kq, sigbar, kq)
    vnorm = np.linalg.norm(v, axis=-1)
    info = dict(rbar=Rb, mubar=mubar, sigbar=sigbar, lam=lam, vnorm=vnorm)
    ns = max(0, min(int(n_sink), S))
    if ns == S:  # every slot is a sink
        out = np.ones((B, Hkv, S))
        info.update(probs=np.zeros((B, Hq, 0)), abar=np.zeros((B, Hkv, 0)))
        return (out, info) if details else out
    lo = 0 if normalize_sinks else ns
    z = lam[..., lo:]
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    p = (e / e.sum(axis=-1, keepdims=True))[..., ns - lo:]  # a-hat of the non-sink slots [B, Hq, S - ns]
    grouped = p.reshape(B, Hkv, G, S - ns)
    if gqa == "mean":
        abar = grouped.mean(axis=2)
    elif gqa == "max":
        abar = grouped.max(axis=2)
    else:
        raise ValueError(f"unknown gqa reduction {gqa!r}")
    body = (abar + epsilon) * vnorm[..., ns:] if use_vnorm else abar.copy()
    sink = body.max() + 1.0  # global over batch, KV heads and slots (kvpress)
    out = np.concatenate([np.full((B, Hkv, ns), sink), body], axis=-1)
    info.update(probs=p, abar=abar)
    return (out, info) if details else out


def prefill(keys, values, queries_prerope, n_sink=4, T=512, theta=10000.0, style="neox", reference="authors",
            **opts):
    """Prefill EA (identical for both references): query row n sits at position n; statistics over the rows with
    position >= n_sink; t0 = S (the context length: the next token's position)."""
    if reference not in ("authors", "kvpress"):
        raise ValueError(f"unknown reference {reference!r}")
    n = np.shape(queries_prerope)[2]
    S = np.shape(keys)[2]
    mean, cov = statistics(queries_prerope, np.arange(n), n_sink)
    return scores(keys, values, mean, cov, S, T, theta, style, n_sink=n_sink, **opts)


def decode(keys, values, buffer_queries, buffer_positions, next_position, reference="authors", n_sink=4, T=512,
           theta=10000.0, style="neox", **opts):
    """Decode-time EA over the whole cache with statistics from a buffer of R pre-RoPE queries [B, Hq, R, d].

    authors (spec A1/A2 resolution): rows with absolute position >= n_sink; t0 = next_position (absolute position
      of the next token).
    kvpress (DecodingPress quirks): rows with buffer index >= n_sink (the first n_sink BUFFER rows are dropped,
      whatever their positions); t0 = R (the buffer length).
    The first n_sink CACHE slots are the sinks in both."""
    R = np.shape(buffer_queries)[2]
    if reference == "authors":
        mean, cov = statistics(buffer_queries, buffer_positions, n_sink)
        t0 = next_position
    elif reference == "kvpress":
        mean, cov = statistics(buffer_queries, np.full(R, n_sink), n_sink, skip_rows=n_sink)
        t0 = R
    else:
        raise ValueError(f"unknown reference {reference!r}")
    return scores(keys, values, mean, cov, t0, T, theta, style, n_sink=n_sink, **opts)


# -------------------------------------------------------------------------------------------------------- selftest
def _top_k(row, keep):
    """Kept indices (ascending): best by (score desc, index asc)."""
    order = np.lexsort((np.arange(len(row)), -np.asarray(row)))
    return sorted(order[:keep].tolist())


GOLDEN = dict(
    qpre0=[[-0.8, -0.2, 0.4, 1.0], [0.2, 0.8, -0.8, -0.2], [-1.0, -0.4, 0.2, 0.8], [0.0, 0.6, -1.0, -0.4],
           [1.0, -0.6, 0.0, 0.6], [-0.2, 0.4, 1.0, -0.6]],
    qpre1=[[0.6, -1.0, -0.4, 0.2], [-0.6, 0.0, 0.6, -1.0], [0.4, 1.0, -0.6, 0.0], [-0.8, -0.2, 0.4, 1.0],
           [0.2, 0.8, -0.8, -0.2], [-1.0, -0.4, 0.2, 0.8]],
    v=[[0.0, 0.6, -1.0, -0.4], [1.0, -0.6, 0.0, 0.6], [-0.2, 0.4, 1.0, -0.6], [0.8, -0.8, -0.2, 0.4],
       [-0.4, 0.2, 0.8, -0.8], [0.6, -1.0, -0.4, 0.2]],
)


def golden_inputs():
    """Spec §2.12: d = 4, theta 1e4 (inv_freq [1, 0.01]), neox, B = 1, Hq = 2, Hkv = 1, S = 6; keys are qpre head0
    rotated to positions 0..5. Returns keys [1,1,6,4], values [1,1,6,4], queries [1,2,6,4]."""
    q = np.array([[GOLDEN["qpre0"], GOLDEN["qpre1"]]])
    keys = apply_rope(np.array(GOLDEN["qpre0"]), np.arange(6), 10000.0, "neox")[None, None]
    return keys, np.array(GOLDEN["v"])[None, None], q


def selftest(verbose=True):
    """Spec §2.12 golden example, exactness check, R-bar closed form, MGF identity. True when all pass."""
    fails = []

    def close(name, got, want, tol):
        got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
        ok = got.shape == want.shape and np.all(np.abs(got - want) <= tol)
        if not ok:
            fails.append(f"{name}: got {np.round(got, 7).tolist()}, expected {want.tolist()} (tol {tol})")
        return ok

    def same(name, got, want):
        if list(got) != list(want):
            fails.append(f"{name}: got {list(got)}, expected {list(want)}")

    # --- golden example, spec §2.12 (printed to 6 decimals: tolerance 1e-6)
    keys, values, q = golden_inputs()
    common = dict(n_sink=2, T=3, theta=10000.0, style="neox")
    s_def, info = prefill(keys, values, q, epsilon=0.01, details=True, **common)
    close("golden R-bar", info["rbar"], [[0.522858, 0, -0.455643, 0], [0, 0.997518, 0, -0.069941],
                                         [0.455643, 0, 0.522858, 0], [0, 0.069941, 0, 0.997518]], 1e-6)
    mean, cov = statistics(q, np.arange(6), 2)
    close("golden mu_0", mean[0, 0], [-0.05, 0, 0.05, 0.1], 1e-12)
    close("golden mu-bar_0", info["mubar"][0, 0], [-0.048925, -0.006994, 0.003361, 0.099752], 1e-6)
    close("golden Sigma_0", cov[0, 0], [[.5075, -.07, -.0975, -.015], [-.07, .26, -.07, -.29],
                                        [-.0975, -.07, .5075, -.015], [-.015, -.29, -.015, .37]], 1e-12)
    close("golden lambda_head0", info["lam"][0, 0, 2:], [0.113743, 0.030596, 0.123006, 0.019499], 1e-6)
    close("golden a-hat head0", info["probs"][0, 0], [0.260445, 0.239666, 0.262869, 0.237021], 1e-6)
    close("golden a-hat head1", info["probs"][0, 1], [0.284707, 0.20642, 0.292002, 0.21687], 1e-6)
    close("golden ||v||", info["vnorm"][0, 0], [1.232883, 1.311488, 1.249, 1.216553, 1.216553, 1.249], 1e-6)
    rows = {
        "eps=0.01 vnorm": (s_def[0, 0], [1.352937, 1.352937, 0.352937, 0.283509, 0.349680, 0.295945]),
        "eps=0 vnorm": (prefill(keys, values, q, epsilon=0.0, **common)[0, 0],
                        [1.340447, 1.340447, 0.340447, 0.271343, 0.337515, 0.283455]),
        "eps=0 no vnorm": (prefill(keys, values, q, epsilon=0.0, use_vnorm=False, **common)[0, 0],
                           [1.277435, 1.277435, 0.272576, 0.223043, 0.277435, 0.226946]),
        "no cov no vnorm": (prefill(keys, values, q, use_covariance=False, use_vnorm=False, **common)[0, 0],
                            [1.279237, 1.279237, 0.279237, 0.228511, 0.270249, 0.222003]),
    }
    for name, (got, want) in rows.items():
        close(f"golden scores {name}", got, want, 1e-6)
    same("golden kept r=0.5 default", _top_k(rows["eps=0.01 vnorm"][0], 3), [0, 1, 2])
    same("golden kept r=0.5 no vnorm", _top_k(rows["eps=0 no vnorm"][0], 3), [0, 1, 4])
    same("golden kept r=0.5 no cov no vnorm", _top_k(rows["no cov no vnorm"][0], 3), [0, 1, 2])
    same("golden kept r=0.25 default", _top_k(rows["eps=0.01 vnorm"][0], 4), [0, 1, 2, 4])
    # the eps-ignored-without-vnorm rule: eps = 0.01 and eps = 0 agree when use_vnorm is off
    close("golden eps ignored without vnorm",
          prefill(keys, values, q, epsilon=0.01, use_vnorm=False, **common)[0, 0], rows["eps=0 no vnorm"][0], 1e-15)

    # --- exactness check: N = 1 (Sigma = 0), T = 1, n_s = 0 -> exact softmax of RoPE(q, 6).k / sqrt(d)
    qx = np.array([0.3, -0.2, 0.5, 0.1])
    mean1, cov1 = statistics(qx[None, None, None, :], [0], 0)
    close("exactness Sigma = 0 for N = 1", cov1, np.zeros((1, 1, 4, 4)), 0.0)
    _, inf1 = scores(keys, values, mean1, cov1, 6, 1, 10000.0, "neox", n_sink=0, details=True)
    want = [0.15821192, 0.16653692, 0.15176084, 0.18828855, 0.1330793, 0.20212246]
    close("exactness a-hat (spec values)", inf1["probs"][0, 0], want, 1e-8)
    logits = apply_rope(qx[None], [6])[0] @ keys[0, 0].T / 2.0
    exact = np.exp(logits - logits.max())
    close("exactness a-hat = exact softmax", inf1["probs"][0, 0], exact / exact.sum(), 1e-12)

    # --- R-bar: brute force = Dirichlet closed form; T = 1 gives R_t0; |rho| <= 1; identity on non-rotary dims
    for d, style, rd, T, t0, theta in ((4, "neox", None, 3, 6, 1e4), (16, "neox", None, 512, 100, 1e4),
                                       (16, "interleaved", None, 37, 1000, 500.0), (12, "neox", 8, 16, 5, 1e4),
                                       (10, "interleaved", 6, 7, 0, 1e4), (8, "neox", None, 1, 42, 1e4)):
        brute = rbar(T, t0, theta, d, style, rd)
        close(f"R-bar closed form d={d} {style} r={rd} T={T} t0={t0}", brute,
              rbar_closed_form(T, t0, theta, d, style, rd), 1e-10)
        if rd is not None:
            close(f"R-bar identity on non-rotary dims d={d} r={rd}", brute[rd:, :], np.eye(d)[rd:, :], 0.0)
    close("R-bar T=1 equals R_t0", rbar(1, 9, 1e4, 8, "interleaved"), rope_matrix(9, 8, 1e4, "interleaved"), 0.0)

    # --- MGF identity by Monte Carlo: E[exp(q.k/sqrt(d))] = exp(lambda) for q ~ N(mu-bar, Sigma-bar)
    mb, sb = info["mubar"][0, 0], info["sigbar"][0, 0]
    w, U = np.linalg.eigh(sb)
    L = U * np.sqrt(np.clip(w, 0.0, None))  # L L^T = Sigma-bar (PSD, possibly singular)
    rng = np.random.default_rng(12345)
    n = 2_000_000
    samples = mb + rng.standard_normal((n, 4)) @ L.T
    s = 0.5  # 1 / sqrt(d), d = 4
    notes = []
    for name, kk in (("key 3", keys[0, 0, 3]), ("3 x key 0", 3.0 * keys[0, 0, 0])):
        x = np.exp(s * (samples @ kk))
        est, se = x.mean(), x.std() / np.sqrt(n)
        lam = s * mb @ kk + 0.5 * s * s * kk @ sb @ kk
        mean_only = s * mb @ kk
        if not abs(est - np.exp(lam)) <= 5 * se:
            fails.append(f"MGF identity {name}: MC mean {est:.6f} +- {se:.1e} vs exp(lambda) {np.exp(lam):.6f}")
        if not abs(est - np.exp(mean_only)) > 20 * se:  # the test must be able to see the covariance term
            fails.append(f"MGF identity {name}: MC cannot tell exp(lambda) from exp(mean term)")
        notes.append(f"{name} MC {est:.6f} +- {se:.1e} vs exp(lambda) {np.exp(lam):.6f}")
    close("MGF lambda of key 3 matches scores()", s * mb @ keys[0, 0, 3] + 0.125 * keys[0, 0, 3] @ sb @ keys[0, 0, 3],
          info["lam"][0, 0, 3], 1e-14)
    mgf_note = f"MGF (n = {n}): " + "; ".join(notes)

    if verbose:
        for f in fails:
            print("FAIL " + f)
        if not fails:
            print("expected_attention selftest: golden §2.12 (R-bar, mu-bar, Sigma, lambda, a-hat, ||v||, 4 score "
                  "rows, kept sets), exactness check, R-bar closed form (6 configs), " + mgf_note + ": all pass")
    return not fails


if __name__ == "__main__":
    import sys
    sys.exit(0 if selftest() else 1)
