# SPDX-License-Identifier: Apache-2.0
"""Writes reference vectors for kvc's tests: inputs and the NumPy oracle's scores and kept sets.

Layout of --out:
  manifest.txt                 one case directory name per line
  <case>/keys.npy values.npy   inputs [B, Hkv, N, d] (float32 or float16)
  <case>/scores_<policy>.npy   oracle scores [B, Hkv, N], float64
  <case>/kept_<policy>_<r>.npy oracle kept indices [B, Hkv, k] (int64, ascending) at ratio r
Cases: random float32, random float16 (the oracle sees the rounded values), and, when the model folder exists,
real keys/values from every layer of tinystories-656k (a story generated greedily by tools/reference/model.py).

Window-attention cases (SnapKV, TOVA; oracle in baselines.py) share --out but are listed in window_manifest.txt:
  <case>/keys.npy values.npy   [B, Hkv, N, d]
  <case>/queries.npy           PRE-RoPE window queries [B, Hq, w, d] (row i at position N - w + i), keys' dtype
  <case>/meta.txt              "window_size W", "theta T", "style neox|interleaved"
  <case>/scores_<variant>.npy, kept_<variant>_<r>.npy   as above, for the variants in WINDOW_VARIANTS
The tinystories_layer<L> window cases reuse the folders of the same-named cases above (identical keys/values).

Stateful cases (Expected Attention, H2O; oracle in expected_attention.py and h2o.py) are listed in
stateful_manifest.txt; their folders are named stateful_<...>:
  <case>/keys.npy              POST-RoPE keys [B, Hkv, S, d] (key j at position j), case dtype
  <case>/values.npy            [B, Hkv, S, d], case dtype
  <case>/queries.npy           PRE-RoPE queries [B, Hq, S, d] (row i at position i), case dtype
  <case>/meta.txt              "theta T", "style neox|interleaved", "n_future_positions 16", "n_sink 4",
                               "buffer 24", "hh H", "recent R", "n_prefill P"
  <case>/scores_<variant>.npy, kept_<variant>_<r>.npy   float64 [B, Hkv, S] / int64 [B, Hkv, int(S (1 - r))], for
                               the variants in STATEFUL_VARIANTS
  <case>/h2o_kept.npy          int64 [B, Hkv, hh + recent]: H2O one-shot keep rule on scores_h2o_accumulated
  <case>/h2o_decode_kept.npy   int64 [B, Hkv, hh + recent]: H2O variant (a), prefill of n_prefill tokens then one
                               token at a time to S - 1: final kept positions (ascending)
  <case>/h2o_decode_scores.npy float64 [B, Hkv, hh + recent]: their accumulated scores
The oracle computes in float64 on the stored (rounded) inputs.

Allocator cases (AdaKV; oracle in allocators.py) are listed in allocator_manifest.txt; their folders are named
adakv_<...>:
  <case>/scores.npy            float32 [B, H, N] (entries at or beyond a head's length are -inf padding)
  <case>/lengths.npy           int64 [B, H]: valid tokens per head
  <case>/meta.txt              "reference authors|kvpress", "alpha A", "budget fixed|ratio", "tokens T" (fixed) or
                               "ratio R" (ratio), "n_sink S", "n_recent R" (numbers as Python's repr: exact doubles)
  <case>/totals.npy            int64 [B, H]: tokens each head keeps, protected included (kvc::allocate's table)
  <case>/kept.npy              int64 [B, H, N]: each head's kept indices, ascending, padded with -1
MomentKV cases (moment_kv.py) are listed in moment_manifest.txt; their folders are named moment_<...>. Each is one
prefill (kvc::moment_kv_prefill with TopKSelector<FixedBudget>{{budget}, n_sink, n_recent}) and the corrected
attention over its result (kvc::attend_corrected). Inputs (case dtype; the oracle computes in float64 on them):
  <case>/keys.npy              POST-RoPE keys [B, Hkv, N, dk] (key j at position j)
  <case>/values.npy            [B, Hkv, N, dv] (dv may differ from dk)
  <case>/queries.npy           POST-RoPE window queries [B, Hq, w, dk], row i at position N - w + i (no RoPE table)
  <case>/attn_queries.npy      POST-RoPE queries of the attention check [B, Hq, nq, dk]
  <case>/attn_positions.npy    int64 [B, nq]: their positions (causal mask over the kept slots' positions)
  <case>/meta.txt              "window_size W", "kernel_size K" (chunk_mean pooling), "budget L", "n_sink S",
                               "n_recent R", "prefill_rounds P", "clamp_tau T" (repr); the scale is 1/sqrt(dk)
Oracle outputs (float64 unless stated):
  <case>/alpha.npy             the frozen base score α [B, Hkv, N]
  <case>/mi_first.npy          the MI scores of round 1 [B, Hkv, N] (n = 0: α‖v‖)
  <case>/kept.npy              int64 [B, Hkv, L]: each head's final kept slots (original indices, ascending)
  <case>/min_gap.npy           [B, Hkv]: the smallest relative score gap at a round's selection boundary (a kept
                               set may differ from kvc's only where this is a near-tie)
  <case>/count.npy             int64 [B, Hkv]; key_mean.npy [B, Hkv, dk]; value_mean.npy [B, Hkv, dv];
                               comoment.npy [B, Hkv, dv, dk]: the final moments (Welford form, C = Σ(v−v̄)(k−k̄)ᵀ)
  <case>/final_alpha.npy       float32 [B, Hkv, L]: α at the kept slots, rounded to float32 (a fixed_base)
  <case>/final_mi.npy          [B, Hkv, L]: MI scores of the kept slots under the final moments, from final_alpha
  <case>/out_corrected.npy lse_corrected.npy   [B, Hq, nq, dv], [B, Hq, nq]: corrected attention (order first)
  <case>/out_zeroth.npy lse_zeroth.npy         the same with order zeroth (f̂_E = v̄)
  <case>/out_plain.npy lse_plain.npy           plain attention over the kept slots
UNComp cases (uncomp.py) are listed in uncomp_manifest.txt; their folders are named uncomp_<...>: post-RoPE keys and
queries of a prompt plus decode steps, the oracle's entropies, groups, budgets, prefill and decode kept sets; plus
the grids uncomp_budgets/ and uncomp_vote/. The exact format is in the docstring of uncomp.py.
RDKV cases (rdkv.py) are listed in rdkv_manifest.txt; their folders are named rdkv_<...>. Inputs (float32 unless
stated; key j of a head at position j, valid slots [0, length)):
  <case>/keys.npy values.npy   POST-RoPE keys and values [B, Hkv, N, d]
  <case>/queries.npy           POST-RoPE window queries [B, Hq, W, d] (no RoPE table)
  <case>/query_positions.npy   int64 [B, W]: their positions (the last W of the sequence's context)
  <case>/lengths.npy           int64 [B, Hkv]: valid slots per head (they differ between heads)
  <case>/attn_queries.npy      POST-RoPE queries of the attention check [B, Hq, nq, d]
  <case>/attn_positions.npy    int64 [B, nq]: their positions (causal mask over the kept tokens' positions)
  <case>/meta.txt              "window_size W", "kernel_size K", "eps_v llama31_v", "eps_k llama31_k" (rdkv.EPS),
                               "weight_gap G" (the smallest stability of an exact plan, see gaps_<plan>)
Oracle outputs (float64 unless stated):
  <case>/token_weights.npy     attn_linear weights [B, Hkv, N] (0 past a head's length)
  <case>/channel_weights.npy   ThinK weights [B, Hkv, d]
  <case>/plans.txt             one plan a line: "name solver budget_tokens ratio rho evict" (solver
                               exact|lagrangian|dp; evict 0: no 0-bit option, the quant-only ablation;
                               ratio -1: budget_tokens; the allocation runs on the weights rounded to float32)
  <case>/v_bits_<plan>.npy     int64 [B, Hkv, N] (0: evicted or padding); k_bits_<plan>.npy int64 [B, Hkv, d]
  <case>/budgets_<plan>.npy    [B, Hkv, 2]: V and K budgets in bits (Σ b; exact and dp use their floor)
  <case>/gaps_<plan>.npy       [B, Hkv, 2]: stability of the head's plan under perturbed token (V) and channel (K)
                               weights: the largest delta of (1e-3, 1e-4, ..., 1e-9, 1e-12) such that weights
                               w (1 + delta U(-1, 1)) give the same v_bits and k_bits (0: an exact tie; inf: dp,
                               compared by its distortion). A plan from weights off by less than delta (relative)
                               must equal the oracle's. A Lagrangian bisection that never converges (its last
                               λ sits on a unit's threshold) is an exact tie: 0.
  <case>/packs.txt             one pack a line: "name plan zero_point v_group k_group clamp_k16_to_8"
  <case>/positions_<pack>.npy  int64 [B, Hkv, N]: kept positions in packed order, padded with -1
  <case>/khat_<pack>.npy vhat_<pack>.npy   dequantised K (original channel order, pruned 0) and V of the kept tokens
                               [B, Hkv, N, d] in packed order (padding rows 0)
  <case>/kmargin_<pack>.npy vmargin_<pack>.npy   float32 [B, Hkv, N, d]: distance of each pre-rounding code to a
                               rounding boundary, in code units (inf: no rounding decision); a code may flip in
                               another arithmetic only where it is tiny
  <case>/out_<pack>.npy lse_<pack>.npy   attention of attn_queries over the kept K^, V^ [B, Hq, nq, d], [B, Hq, nq]
PyramidKV schedules (allocators.py) in pyramid_kv/:
  params.npy                   float64 [M, 7]: reference (0 authors, 1 kvpress), n, max_capacity_prompt (authors;
                               0: int(n (1 - ratio))), compression_ratio, window, beta, layers
  keep.npy                     int64 [M, max layers]: tokens each layer keeps (window included), padded with -1
Exit code 77 (ctest's skip code) when NumPy is missing.
"""
import argparse
import json
import math
import os
import sys

try:
    import numpy as np
except ImportError:
    print("SKIPPED: NumPy is not installed (apt-get install python3-numpy)")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import allocators  # noqa: E402
import baselines  # noqa: E402
import expected_attention  # noqa: E402
import h2o  # noqa: E402
import moment_kv  # noqa: E402
import oracle  # noqa: E402
import rdkv  # noqa: E402
import uncomp  # noqa: E402

RATIOS = (0.25, 0.5, 0.75)
# variant -> baselines parameters; every SnapKV variant uses the case's window_size
WINDOW_VARIANTS = {
    "snap_kv_authors": dict(kernel_size=7, pooling="max", gqa="mean", reference="authors"),
    "snap_kv_kvpress": dict(kernel_size=5, pooling="avg", gqa="mean", reference="kvpress"),
    "snap_kv_authors_avg_sum": dict(kernel_size=5, pooling="avg", gqa="sum", reference="authors"),
    "snap_kv_authors_pqh": dict(kernel_size=7, pooling="max", gqa="per_query_head", reference="authors"),  # g == 1
    "tova_authors": dict(reference="authors"),
    "tova_kvpress": dict(reference="kvpress"),
}
DEFAULT_WINDOW_VARIANTS = [v for v in WINDOW_VARIANTS if v != "snap_kv_authors_pqh"]


def save_scores_and_kept(d, policy, s):
    """scores_<policy>.npy, and kept_<policy>_<r>.npy: top-k per (b, head) at keep = int(N (1 - r))."""
    B, H, N = s.shape
    np.save(os.path.join(d, f"scores_{policy}.npy"), s)
    for r in RATIOS:
        keep = oracle.ratio_keep(N, r)
        kept = np.stack([np.stack([oracle.top_k(s[b, h], keep) for h in range(H)]) for b in range(B)])
        np.save(os.path.join(d, f"kept_{policy}_{r}.npy"), kept.astype(np.int64))


def write_case(out, name, keys, values):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    np.save(os.path.join(d, "keys.npy"), keys)
    np.save(os.path.join(d, "values.npy"), values)
    k64 = keys.astype(np.float64)
    B, H, N, _ = keys.shape
    scores = {"key_diff": oracle.key_diff_scores(k64), "knorm": oracle.knorm_scores(k64)}
    for policy, s in scores.items():
        save_scores_and_kept(d, policy, s)
    for r in RATIOS:
        kept = oracle.streaming_llm_keep(N, oracle.ratio_keep(N, r), 4)
        np.save(os.path.join(d, f"kept_streaming_llm_{r}.npy"), np.broadcast_to(kept, (B, H, len(kept))).copy())
    return name


def boundary_gaps(s, keep):
    """Score gaps, one per (b, head), between the keep-th and (keep+1)-th best token (0: a tie, broken by index)."""
    top = -np.sort(-s.reshape(-1, s.shape[-1]), axis=-1)
    return top[:, keep - 1] - top[:, keep] if keep < s.shape[-1] else np.array([])


def write_window_case(out, name, keys, values, queries, theta=10000.0, style="neox", variants=None):
    """One window-attention case: inputs, meta.txt, and the oracle's scores and kept sets per variant."""
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    queries = queries.astype(keys.dtype)  # the oracle sees the rounded values
    w = queries.shape[2]
    for f, x in (("keys", keys), ("values", values), ("queries", queries)):
        np.save(os.path.join(d, f"{f}.npy"), x)
    with open(os.path.join(d, "meta.txt"), "w") as f:
        f.write(f"window_size {w}\ntheta {theta:g}\nstyle {style}\n")
    k64, q64 = keys.astype(np.float64), queries.astype(np.float64)
    notes = []
    for v in variants or DEFAULT_WINDOW_VARIANTS:
        if v.startswith("tova"):
            s = baselines.tova_scores(k64, q64, theta=theta, style=style, **WINDOW_VARIANTS[v])
        else:
            s = baselines.snap_kv_scores(k64, q64, w, theta=theta, style=style, **WINDOW_VARIANTS[v])
        save_scores_and_kept(d, v, s)
        g = np.concatenate([boundary_gaps(s, oracle.ratio_keep(s.shape[-1], r)) for r in RATIOS])
        ties = f" ({np.sum(g == 0)} ties)" if np.any(g == 0) else ""
        notes.append(f"{v} {g[g > 0].min(initial=np.inf):.1e}{ties}")
    print(f"{name}: smallest nonzero selection-boundary gap: " + ", ".join(notes))
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="", help="tinystories-656k folder (optional)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(20261121)
    cases = []
    k = (rng.standard_normal((2, 3, 257, 32)) + 0.2).astype(np.float32)
    v = rng.standard_normal((2, 3, 257, 32)).astype(np.float32)
    cases.append(write_case(a.out, "random_f32", k, v))
    k16 = (rng.standard_normal((1, 4, 300, 64)) * 2).astype(np.float16)
    cases.append(write_case(a.out, "random_f16", k16, rng.standard_normal((1, 4, 300, 64)).astype(np.float16)))
    if a.model and os.path.exists(os.path.join(a.model, "model.safetensors")):
        import model

        dump = os.path.join(a.out, "tinystories_dump")
        model.dump(a.model, dump, n_tokens=160)
        for layer in sorted(x for x in os.listdir(dump) if x.startswith("layer")):
            kk = np.load(os.path.join(dump, layer, "keys.npy"))
            vv = np.load(os.path.join(dump, layer, "values.npy"))
            cases.append(write_case(a.out, f"tinystories_{layer}", kk, vv))
    else:
        print(f"note: model folder '{a.model}' absent: real-model vectors skipped")
    with open(os.path.join(a.out, "manifest.txt"), "w") as f:
        f.write("\n".join(cases) + "\n")
    print(f"wrote {len(cases)} cases to {a.out}")
    window_cases = write_window_cases(a.out, a.model)
    with open(os.path.join(a.out, "window_manifest.txt"), "w") as f:
        f.write("\n".join(window_cases) + "\n")
    print(f"wrote {len(window_cases)} window-attention cases to {a.out}")
    stateful_cases = write_stateful_cases(a.out, a.model)
    with open(os.path.join(a.out, "stateful_manifest.txt"), "w") as f:
        f.write("\n".join(stateful_cases) + "\n")
    print(f"wrote {len(stateful_cases)} stateful (Expected Attention, H2O) cases to {a.out}")
    allocator_cases = write_allocator_cases(a.out, window_cases)
    with open(os.path.join(a.out, "allocator_manifest.txt"), "w") as f:
        f.write("\n".join(allocator_cases) + "\n")
    print(f"wrote {len(allocator_cases)} AdaKV allocation cases and {write_pyramid_schedules(a.out)} PyramidKV "
          f"schedules to {a.out}")
    moment_cases = write_moment_cases(a.out, a.model)
    with open(os.path.join(a.out, "moment_manifest.txt"), "w") as f:
        f.write("\n".join(moment_cases) + "\n")
    print(f"wrote {len(moment_cases)} MomentKV cases to {a.out}")
    uncomp_cases = write_uncomp_cases(a.out, a.model)
    with open(os.path.join(a.out, "uncomp_manifest.txt"), "w") as f:
        f.write("\n".join(uncomp_cases) + "\n")
    print(f"wrote {len(uncomp_cases)} UNComp cases, {write_uncomp_budget_grid(a.out)} budget rows and "
          f"{write_uncomp_vote_grid(a.out)} vote rows to {a.out}")
    rdkv_cases = write_rdkv_cases(a.out, a.model)
    with open(os.path.join(a.out, "rdkv_manifest.txt"), "w") as f:
        f.write("\n".join(rdkv_cases) + "\n")
    print(f"wrote {len(rdkv_cases)} RDKV cases to {a.out}")


def write_window_cases(out, model_dir):
    """Random GQA/MHA cases (queries scaled by 2.5 so attention is peaked), plus tinystories layers if dumped."""
    rng = np.random.default_rng(20261122)  # separate stream: the cases above stay byte-identical

    def rand(shape, dtype, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    cases = []
    for name, (B, Hkv, Hq, N, d, w), dtype, style, extra in (
            ("random_gqa_f32", (2, 2, 4, 150, 32, 16), np.float32, "neox", []),
            ("random_gqa_f16", (1, 2, 8, 200, 64, 8), np.float16, "neox", []),
            ("random_mha_interleaved", (1, 3, 3, 90, 16, 8), np.float32, "interleaved", ["snap_kv_authors_pqh"])):
        k, v = rand((B, Hkv, N, d), dtype), rand((B, Hkv, N, d), dtype)
        q = rand((B, Hq, w, d), dtype, 2.5)
        cases.append(write_window_case(out, name, k, v, q, 10000.0, style, DEFAULT_WINDOW_VARIANTS + extra))
    dump = os.path.join(out, "tinystories_dump")
    if model_dir and os.path.exists(os.path.join(model_dir, "model.safetensors")):  # main() has just dumped it
        with open(os.path.join(model_dir, "config.json")) as f:
            theta = float(json.load(f).get("rope_theta", 10000.0))
        for layer in sorted(x for x in os.listdir(dump) if x.startswith("layer")):
            ld = os.path.join(dump, layer)
            kk, vv = np.load(os.path.join(ld, "keys.npy")), np.load(os.path.join(ld, "values.npy"))
            n, w = kk.shape[2], 16
            q = np.load(os.path.join(ld, "queries_prerope.npy"))[:, :, n - w:]
            # cross-check: baselines.rope reproduces the model's own post-RoPE queries
            q_post = np.load(os.path.join(ld, "queries.npy"))[:, :, n - w:]
            err = np.abs(baselines.rope(q, np.arange(n - w, n), theta, "neox") - q_post).max()
            if err > 1e-4 * max(1.0, np.abs(q_post).max()):
                sys.exit(f"{layer}: baselines.rope differs from model.py's RoPE by {err}")
            cases.append(write_window_case(out, f"tinystories_{layer}", kk, vv, q, theta, "neox"))
    return cases


# Stateful policies. Every EA variant: n_sink 4, T = n_future_positions from meta.txt, softmax scale 1/sqrt(d), and
# unless the variant says otherwise epsilon 0.01, covariance on, vnorm on, GQA mean, sinks outside the softmax.
STATEFUL_EA = dict(n_sink=4, T=16, buffer=24)
STATEFUL_VARIANTS = {
    "ea_default": dict(),
    "ea_eps0": dict(epsilon=0.0),
    "ea_nocov": dict(use_covariance=False),
    "ea_novnorm": dict(use_vnorm=False),
    "ea_gqa_max": dict(gqa="max"),
    "ea_sinks_normalized": dict(normalize_sinks=True),
    "ea_decode_authors": dict(decode="authors"),  # buffer = the last `buffer` query rows, next position S
    "ea_decode_kvpress": dict(decode="kvpress"),
    "h2o_kvpress": None,  # kvpress ObservedAttentionPress: column sums / (S - j), group mean
    "h2o_accumulated": None,  # H2O's raw column sums, group mean
}


def stateful_scores(variant, k64, v64, q64, theta, style):
    """The oracle's [B, Hkv, S] scores of one STATEFUL_VARIANTS entry (float64 inputs)."""
    if variant == "h2o_kvpress":
        return h2o.observed_attention_scores(k64, q64, theta, style)
    if variant == "h2o_accumulated":
        return h2o.accumulated(k64, q64, theta, style)
    opts = dict(STATEFUL_VARIANTS[variant])
    mode = opts.pop("decode", None)
    common = dict(n_sink=STATEFUL_EA["n_sink"], T=STATEFUL_EA["T"], theta=theta, style=style,
                  epsilon=opts.pop("epsilon", 0.01), **opts)
    if mode is None:
        return expected_attention.prefill(k64, v64, q64, **common)
    n, r = q64.shape[2], STATEFUL_EA["buffer"]
    return expected_attention.decode(k64, v64, q64[:, :, n - r:], np.arange(n - r, n), n, mode, **common)


def write_stateful_case(out, name, keys, values, queries, theta, style, hh, recent, n_prefill):
    """One stateful case: inputs (keys post-RoPE, queries pre-RoPE), meta.txt, and the oracle's outputs."""
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    values, queries = values.astype(keys.dtype), queries.astype(keys.dtype)  # the oracle sees the rounded values
    S = keys.shape[2]
    if not hh + recent <= S or not 0 <= n_prefill <= S or queries.shape[2] != S:
        raise ValueError(f"{name}: inconsistent sizes")
    for f, x in (("keys", keys), ("values", values), ("queries", queries)):
        np.save(os.path.join(d, f"{f}.npy"), x)
    with open(os.path.join(d, "meta.txt"), "w") as f:
        f.write(f"theta {theta:g}\nstyle {style}\nn_future_positions {STATEFUL_EA['T']}\n"
                f"n_sink {STATEFUL_EA['n_sink']}\nbuffer {STATEFUL_EA['buffer']}\nhh {hh}\nrecent {recent}\n"
                f"n_prefill {n_prefill}\n")
    k64, v64, q64 = (x.astype(np.float64) for x in (keys, values, queries))
    notes = []
    acc = None
    for v in STATEFUL_VARIANTS:
        s = stateful_scores(v, k64, v64, q64, theta, style)
        acc = s if v == "h2o_accumulated" else acc
        save_scores_and_kept(d, v, s)
        g = np.concatenate([boundary_gaps(s, oracle.ratio_keep(S, r)) for r in RATIOS])
        # relative to the keep-th best score of that head (EA scores are ~1/S, so absolute gaps look small)
        kth = np.concatenate([-np.sort(-s.reshape(-1, S), axis=-1)[:, oracle.ratio_keep(S, r) - 1] for r in RATIOS])
        ties = f" ({np.sum(g == 0)} ties)" if np.any(g == 0) else ""
        rel = (g / np.abs(kth))[g > 0].min(initial=np.inf)
        notes.append(f"{v} {g[g > 0].min(initial=np.inf):.1e} (rel {rel:.1e}){ties}")
    B, H = acc.shape[:2]
    kept = np.array([[h2o.prefill_keep(acc[b, h], hh, recent) for h in range(H)] for b in range(B)], dtype=np.int64)
    np.save(os.path.join(d, "h2o_kept.npy"), kept)
    cand = acc[..., : S - recent]  # the heavy-hitter boundary among the candidates
    g = boundary_gaps(cand, hh) if hh else np.array([])
    notes.append(f"h2o_kept {g[g > 0].min(initial=np.inf):.1e}" + (f" ({np.sum(g == 0)} ties)" if np.any(g == 0)
                                                                    else ""))
    stats = {}
    dk, ds = h2o.simulate(k64, v64, q64, n_prefill, hh, recent, theta, style, stats=stats)
    np.save(os.path.join(d, "h2o_decode_kept.npy"), dk.astype(np.int64))
    np.save(os.path.join(d, "h2o_decode_scores.npy"), ds.astype(np.float64))
    notes.append(f"h2o_decode (every eviction) {stats['min_gap']:.1e}")
    print(f"{name}: smallest nonzero selection-boundary gap: " + ", ".join(notes))
    return name


def write_stateful_cases(out, model_dir):
    """Random GQA f32 (neox) and MHA f16 (interleaved) cases, plus one per tinystories layer when dumped."""
    rng = np.random.default_rng(20261125)  # separate stream: every case above stays byte-identical
    cases = []
    for name, (B, Hkv, Hq, S, d), dtype, style, (hh, recent, n_prefill) in (
            ("stateful_random_gqa_f32", (2, 2, 4, 96, 32), np.float32, "neox", (16, 8, 48)),
            ("stateful_random_mha_f16_interleaved", (1, 3, 3, 80, 16), np.float16, "interleaved", (12, 8, 40))):
        theta = 10000.0
        # pre-RoPE keys and queries with a per-head mean direction (so mu matters), queries scaled by 1.5
        kpre = rng.standard_normal((B, Hkv, S, d)) + 0.5 * rng.standard_normal((1, Hkv, 1, d))
        keys = baselines.rope(kpre, np.arange(S), theta, style).astype(dtype)  # post-RoPE at positions 0..S-1
        values = rng.standard_normal((B, Hkv, S, d)).astype(dtype)
        q = 1.5 * (rng.standard_normal((B, Hq, S, d)) + 0.5 * rng.standard_normal((1, Hq, 1, d)))
        cases.append(write_stateful_case(out, name, keys, values, q.astype(dtype), theta, style, hh, recent,
                                         n_prefill))
    dump = os.path.join(out, "tinystories_dump")
    if model_dir and os.path.exists(os.path.join(model_dir, "model.safetensors")):  # main() has just dumped it
        with open(os.path.join(model_dir, "config.json")) as f:
            theta = float(json.load(f).get("rope_theta", 10000.0))
        for layer in sorted(x for x in os.listdir(dump) if x.startswith("layer")):
            ld = os.path.join(dump, layer)
            kk, vv = np.load(os.path.join(ld, "keys.npy")), np.load(os.path.join(ld, "values.npy"))
            qq = np.load(os.path.join(ld, "queries_prerope.npy"))
            cases.append(write_stateful_case(out, f"stateful_tinystories_{layer}", kk, vv, qq, theta, "neox",
                                             24, 16, 64))
    return cases



def write_allocator_case(out, name, scores, lengths, reference, alpha, budget, n_sink, n_recent):
    """One AdaKV case: float32 scores (padding -inf), lengths, meta.txt, the oracle's totals and kept sets.

    budget: ("fixed", tokens) or ("ratio", fraction removed)."""
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    B, H, N = scores.shape
    scores = scores.astype(np.float32).copy()
    for b in range(B):
        for h in range(H):
            scores[b, h, lengths[b, h]:] = -np.inf
    kind, value = budget
    keep = allocators.fixed_keep(value) if kind == "fixed" else allocators.ratio_keep(value)
    s64 = scores.astype(np.float64).tolist()  # the oracle ranks the stored float32 values (exact in float64)
    totals = allocators.ada_kv_allocate(s64, lengths.tolist(), keep, alpha, reference, n_sink, n_recent)
    kept = allocators.ada_kv_kept(s64, lengths.tolist(), totals, n_sink, n_recent)
    padded = np.full((B, H, N), -1, dtype=np.int64)
    for b in range(B):
        for h in range(H):
            padded[b, h, : len(kept[b][h])] = kept[b][h]
    np.save(os.path.join(d, "scores.npy"), scores)
    np.save(os.path.join(d, "lengths.npy"), lengths.astype(np.int64))
    np.save(os.path.join(d, "totals.npy"), np.array(totals, dtype=np.int64))
    np.save(os.path.join(d, "kept.npy"), padded)
    with open(os.path.join(d, "meta.txt"), "w") as f:
        f.write(f"reference {reference}\nalpha {alpha!r}\nbudget {kind}\n"
                f"{'tokens' if kind == 'fixed' else 'ratio'} {value!r}\nn_sink {n_sink}\nn_recent {n_recent}\n")
    return name


def exact_ties(scores, lengths):
    """Pairs of equal valid scores within each sequence (the tie order then decides; random cases have none)."""
    count = 0
    for b in range(scores.shape[0]):
        v = np.concatenate([scores[b, h, : lengths[b, h]] for h in range(scores.shape[1])])
        count += len(v) - len(np.unique(v))
    return count


def write_allocator_cases(out, window_cases):
    """AdaKV cases: random float32 scores [2, 4, 64] with per-head lengths (both behaviours, alpha in {0, 0.2, 0.5,
    1}, FixedBudget and RatioBudget, with and without protected tokens), a short-prompt case, a case of exact ties
    (both sides order them by score, head, index), and SnapKV scores of tinystories-656k when they were written."""
    rng = np.random.default_rng(20261127)  # separate stream: every case above stays byte-identical
    B, H, N = 2, 4, 64
    lengths = np.array([[64, 51, 40, 57], [45, 64, 62, 48]], dtype=np.int64)
    # uneven heads, so the adaptive budgets differ: a per-head scale, skewed values
    while True:
        scores = (rng.random((B, H, N)) * rng.random((B, H, N)) * rng.uniform(0.2, 1.0, (B, H, 1))).astype(np.float32)
        if exact_ties(scores, lengths) == 0:
            break
    cases = []
    for reference in ("authors", "kvpress"):
        for alpha in (0.0, 0.2, 0.5, 1.0):
            for budget in (("fixed", 24), ("ratio", 0.6)):
                for n_sink, n_recent in ((0, 0), (2, 6)):
                    tag = f"{budget[0]}{budget[1]}"
                    cases.append(write_allocator_case(out, f"adakv_{reference}_a{alpha}_{tag}_s{n_sink}r{n_recent}",
                                                      scores, lengths, reference, alpha, budget, n_sink, n_recent))
        cases.append(write_allocator_case(out, f"adakv_{reference}_a0.3_ratio0.25_s4r8", scores, lengths, reference,
                                          0.3, ("ratio", 0.25), 4, 8))
        # short prompt: the budget covers every head (authors: no compression, §5.1 step 2); alpha 0.5 and odd
        # candidate counts, where the mix alone would round tokens away
        cases.append(write_allocator_case(out, f"adakv_{reference}_a0.5_fixed64_short_s0r6", scores, lengths,
                                          reference, 0.5, ("fixed", 64), 0, 6))
        # ratio 0 (nothing removed) at the default alpha 0.2: every head keeps its whole length
        cases.append(write_allocator_case(out, f"adakv_{reference}_a0.2_ratio0.0_s0r0", scores, lengths, reference,
                                          0.2, ("ratio", 0.0), 0, 0))
        # exact ties everywhere (multiples of 1/8): kvc and the oracle both rank by (score desc, head, index)
        tied = np.floor(scores / scores.max() * 8).astype(np.float32) / 8
        for alpha in (0.2, 0.5):
            cases.append(write_allocator_case(out, f"adakv_{reference}_a{alpha}_ties_fixed20_s1r3", tied, lengths,
                                              reference, alpha, ("fixed", 20), 1, 3))
    # real scores: SnapKV (window w = 16, folded in as max + 1) of tinystories-656k's layers; the window is protected
    real = [c for c in window_cases if c.startswith("tinystories_layer")]
    for case in real:
        for reference, variant, alpha, budget in (("authors", "snap_kv_authors", 0.2, ("fixed", 48)),
                                                  ("authors", "snap_kv_authors", 0.5, ("ratio", 0.75)),
                                                  ("kvpress", "snap_kv_kvpress", 0.2, ("ratio", 0.75)),
                                                  ("kvpress", "snap_kv_kvpress", 0.5, ("fixed", 48))):
            s = np.load(os.path.join(out, case, f"scores_{variant}.npy")).astype(np.float32)
            lens = np.full(s.shape[:2], s.shape[2], dtype=np.int64)
            name = f"adakv_{case}_{variant}_a{alpha}_{budget[0]}{budget[1]}"
            cases.append(write_allocator_case(out, name, s, lens, reference, alpha, budget, 0, 16))
            print(f"{name}: {exact_ties(s, lens)} exact ties among the float32 scores (ordered by head, index)")
    return cases


def write_moment_case(out, name, keys, values, queries, attn_queries, attn_positions, budget, n_sink, n_recent,
                      rounds, kernel_size=4, tau=1e-6, require_gap=0.0):
    """One MomentKV case: inputs, meta.txt, the oracle's prefill result and attention outputs (see the docstring).
    Returns None, writing nothing, when a round's selection boundary is closer than require_gap (relative)."""
    values, queries, attn_queries = (x.astype(keys.dtype) for x in (values, queries, attn_queries))
    attn_positions = np.asarray(attn_positions, dtype=np.int64)
    k64, v64, q64, a64 = (x.astype(np.float64) for x in (keys, values, queries, attn_queries))
    B, Hkv, N, dk = keys.shape
    c = 1.0 / np.sqrt(dk)
    alpha, res = moment_kv.prefill(k64, v64, q64, budget, n_sink, n_recent, rounds, kernel_size, c, tau)
    gaps = np.array([[r["min_gap"] for r in row] for row in res])
    if gaps.min() < require_gap:
        return None
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    for f, x in (("keys", keys), ("values", values), ("queries", queries), ("attn_queries", attn_queries),
                 ("attn_positions", attn_positions)):
        np.save(os.path.join(d, f"{f}.npy"), x)
    w = queries.shape[2]
    with open(os.path.join(d, "meta.txt"), "w") as f:
        f.write(f"window_size {w}\nkernel_size {kernel_size}\nbudget {budget}\nn_sink {n_sink}\nn_recent {n_recent}\n"
                f"prefill_rounds {rounds}\nclamp_tau {tau!r}\n")
    kept = np.array([[r["kept"] for r in row] for row in res], dtype=np.int64)  # every head ends at the same L
    moms = [[r["moments"] for r in row] for row in res]
    np.save(os.path.join(d, "alpha.npy"), alpha)
    np.save(os.path.join(d, "mi_first.npy"), np.array([[r["mi_first"] for r in row] for row in res]))
    np.save(os.path.join(d, "kept.npy"), kept)
    np.save(os.path.join(d, "min_gap.npy"), gaps)
    np.save(os.path.join(d, "count.npy"), np.array([[m["n"] for m in row] for row in moms], dtype=np.int64))
    for f, key in (("key_mean", "km"), ("value_mean", "vm"), ("comoment", "C")):
        np.save(os.path.join(d, f"{f}.npy"), np.array([[m[key] for m in row] for row in moms]))
    fa = np.array([[alpha[b, h, kept[b, h]] for h in range(Hkv)] for b in range(B)]).astype(np.float32)
    np.save(os.path.join(d, "final_alpha.npy"), fa)
    fm = np.array([[moment_kv.mi_scores(fa[b, h].astype(np.float64), k64[b, h, kept[b, h]], v64[b, h, kept[b, h]],
                                        moms[b][h], c, tau) for h in range(Hkv)] for b in range(B)])
    np.save(os.path.join(d, "final_mi.npy"), fm)
    out_c, lse_c, out_p, lse_p = moment_kv.corrected_attention(a64, attn_positions, k64, v64, kept, moms, c, tau)
    out_z, lse_z, _, _ = moment_kv.corrected_attention(a64, attn_positions, k64, v64, kept, moms, c, tau, "zeroth")
    for f, x in (("out_corrected", out_c), ("lse_corrected", lse_c), ("out_zeroth", out_z), ("lse_zeroth", lse_z),
                 ("out_plain", out_p), ("lse_plain", lse_p)):
        np.save(os.path.join(d, f"{f}.npy"), x)
    # diagnostics: the outputs' errors against full attention over all N slots
    every = [[np.arange(N)] * Hkv] * B
    none = [[moment_kv.empty_moments(dk, values.shape[-1])] * Hkv] * B
    full = moment_kv.corrected_attention(a64, attn_positions, k64, v64, every, none, c, tau)[0]

    def rel(x):
        return np.mean(np.linalg.norm(x - full, axis=-1) / np.linalg.norm(full, axis=-1))

    print(f"{name}: N {N}, L {kept.shape[2]}, {rounds} rounds, smallest boundary gap {gaps.min():.1e}; mean error "
          f"vs full attention: corrected {rel(out_c):.3f}, zeroth {rel(out_z):.3f}, plain {rel(out_p):.3f}")
    return name


def write_moment_cases(out, model_dir):
    """Random GQA cases (Hq 4, Hkv 2: float32 and float16, d_k != d_v once, 1, 3, 8 and N − L rounds, a budget
    below the protected slots, more rounds than evictions; redrawn until no selection boundary is a near-tie), plus
    tinystories-656k's layers when dumped (w = 32, budget 64, 8 rounds; layer 0 also N − L rounds: its values repeat
    with the token, so exact ties of score 0 occur, broken by index)."""
    rng = np.random.default_rng(20261129)  # separate stream: every case above stays byte-identical
    cases = []
    for name, (B, Hkv, Hq, N, dk, dv, w), dtype, (budget, n_sink, n_recent, rounds) in (
            ("moment_gqa_f32_r1", (2, 2, 4, 200, 32, 32, 16), np.float32, (64, 1, 16, 1)),
            ("moment_gqa_f32_r3", (1, 2, 4, 257, 32, 32, 16), np.float32, (100, 1, 16, 3)),
            ("moment_gqa_f32_r8", (2, 2, 4, 180, 16, 16, 16), np.float32, (48, 1, 16, 8)),
            ("moment_gqa_f16_r8", (1, 2, 4, 300, 32, 32, 32), np.float16, (96, 1, 32, 8)),
            ("moment_gqa_f32_dk32_dv16_r3", (1, 2, 4, 150, 32, 16, 16), np.float32, (40, 2, 8, 3)),
            ("moment_gqa_f16_small_budget_r3", (1, 2, 4, 100, 24, 24, 16), np.float16, (8, 4, 16, 3)),
            ("moment_gqa_f32_few_evictions_r8", (1, 2, 4, 100, 16, 16, 8), np.float32, (95, 1, 8, 8)),
            ("moment_gqa_f32_greedy", (1, 2, 4, 72, 16, 16, 8), np.float32, (24, 1, 8, None))):
        if rounds is None:  # N − L: one eviction per round, the exact greedy
            rounds = N - moment_kv.fixed_budget(N, budget, n_sink, n_recent)
        written = None
        while written is None:  # redraw until no round's boundary is a near-tie (1e-4 relative)
            keys = rng.standard_normal((B, Hkv, N, dk)) + 0.5 * rng.standard_normal((1, Hkv, 1, dk))
            values = rng.standard_normal((B, Hkv, N, dv)) + 0.3 * rng.standard_normal((1, Hkv, 1, dv))
            q = 1.5 * rng.standard_normal((B, Hq, w + 1, dk))
            # attention rows: the first and last two window rows, and a fresh query at position N (a decode step)
            rows = [0, w - 2, w - 1, w]
            positions = np.broadcast_to(np.array([N - w, N - 2, N - 1, N]), (B, 4))
            written = write_moment_case(out, name, keys.astype(dtype), values, q[:, :, :w], q[:, :, rows], positions,
                                        budget, n_sink, n_recent, rounds, require_gap=1e-4)
        cases.append(written)
    dump = os.path.join(out, "tinystories_dump")
    if model_dir and os.path.exists(os.path.join(model_dir, "model.safetensors")):  # main() has just dumped it
        for layer in sorted(x for x in os.listdir(dump) if x.startswith("layer")):
            ld = os.path.join(dump, layer)
            kk, vv = np.load(os.path.join(ld, "keys.npy")), np.load(os.path.join(ld, "values.npy"))
            qq = np.load(os.path.join(ld, "queries.npy"))  # the model's own post-RoPE queries, row i at position i
            n, w = kk.shape[2], 32
            pos = np.array([n - w, n - w // 2, n - 2, n - 1])
            positions = np.broadcast_to(pos, (kk.shape[0], 4))
            for tag, rounds in (("r8", 8), ("greedy", n - moment_kv.fixed_budget(n, 64, 1, w))):
                if tag == "greedy" and layer != "layer0":
                    continue
                cases.append(write_moment_case(out, f"moment_tinystories_{layer}_{tag}", kk, vv, qq[:, :, n - w:],
                                               qq[:, :, pos], positions, 64, 1, w, rounds))
    return cases


def uncomp_rank_gap(x):
    """Smallest relative gap between two entries of x (0: an exact tie; the grouping then follows the index)."""
    v = np.sort(np.asarray(x, dtype=np.float64).ravel())
    if v.size < 2:
        return np.inf
    return float(np.min(np.diff(v) / np.maximum(np.abs(v[1:]), 1e-300)))


def uncomp_entropy_variants(n, d):
    """(name, rows, top_k, normalize_rows, renormalize_topk, ridge); "authors" is the calibration entropy."""
    k = max(1, d // 4)
    return [("authors", n, k, 1, 0, 0.0), ("covariance", n, k, 0, 0, 0.0), ("authors_ridge", n, k, 1, 0, 1e-10),
            ("authors_renormalized", n, k, 1, 1, 0.0), ("authors_k_all", n, 2 * d, 1, 0, 0.0),
            ("gram_rows", d // 2, k, 1, 0, 0.0), ("gram_covariance_renormalized", d // 2, k, 0, 1, 0.0)]


def write_uncomp_case(out, name, keys, queries, N, T, w, groups_q, groups_kv, average, step, require_gap=0.0):
    """One UNComp case (format: uncomp.py's docstring). keys [B, Hkv, N + T, d], queries [B, Hq, N + T, d], both
    post-RoPE. Returns None, writing nothing, when a ranking or selection boundary is closer than require_gap."""
    keys = np.ascontiguousarray(keys, dtype=np.float32)
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    k64, q64 = keys.astype(np.float64), queries.astype(np.float64)
    B, Hkv, total, d = keys.shape
    Hq = queries.shape[1]
    assert total == N + T and queries.shape[2] == total
    variants = uncomp_entropy_variants(N, d)
    tables = {v[0]: uncomp.entropy_table(q64, *v[1:]) for v in variants}
    erank_b = tables["authors"][:, :, 2]  # [B, Hq]
    erank_q = erank_b.mean(axis=0)
    normalized_q = tables["authors"][:, :, 3].mean(axis=0)
    groups_q_ = uncomp.group_heads(erank_q, groups_q)
    labels = [uncomp.group_heads(erank_b[b], groups_q) for b in range(B)]
    vote = uncomp.majority_vote_groups(labels, groups_q)
    budgets_q = uncomp.head_budgets(average, groups_q, step, groups_q_, w)
    erank_kv = uncomp.reduce_to_kv_heads(erank_q, Hkv)
    groups_kv_ = uncomp.group_heads(erank_kv, groups_kv)
    budgets_kv = uncomp.head_budgets(average, groups_kv, step, groups_kv_, w)
    A, pooled, kept, pgap = uncomp.prefill(k64[:, :, :N], q64[:, :, N - w:N], budgets_kv, w)
    g = Hq // Hkv
    evicted = np.full((B, Hkv, T), -1, dtype=np.int64)
    final = np.full((B, Hkv, N + T), -1, dtype=np.int64)
    dgap = np.full((B, Hkv, T), np.inf)
    for b in range(B):
        for h in range(Hkv):
            ev, fin, gp = uncomp.decode_head(k64[b, h], q64[b, h * g:(h + 1) * g], g, kept[b][h], A[b, h],
                                             budgets_kv[h], w, T)
            evicted[b, h], dgap[b, h] = ev, gp
            final[b, h, :len(fin)] = fin
    rank_gap = min([uncomp_rank_gap(erank_q), uncomp_rank_gap(erank_kv)] + [uncomp_rank_gap(e) for e in erank_b])
    sel_gap = min(pgap.min(), dgap.min())
    if min(rank_gap, sel_gap) < require_gap:
        return None
    d_ = os.path.join(out, name)
    os.makedirs(d_, exist_ok=True)
    np.save(os.path.join(d_, "keys.npy"), keys)
    np.save(os.path.join(d_, "queries.npy"), queries)
    with open(os.path.join(d_, "meta.txt"), "w") as f:
        f.write(f"window_size {w}\nkernel_size 7\nprefill_length {N}\ndecode_steps {T}\ngroups_q {groups_q}\n"
                f"groups_kv {groups_kv}\naverage {float(average)!r}\nstep {float(step)!r}\ntheta 10000\n"
                f"rank_gap {rank_gap:.3e}\nselection_gap {sel_gap:.3e}\n")
    with open(os.path.join(d_, "entropy.txt"), "w") as f:
        for v in variants:
            f.write(f"{v[0]} {v[1]} {v[2]} {v[3]} {v[4]} {v[5]!r}\n")
    for v in variants:
        np.save(os.path.join(d_, f"entropy_{v[0]}.npy"), tables[v[0]])
    padded = np.full((B, Hkv, N), -1, dtype=np.int64)
    for b in range(B):
        for h in range(Hkv):
            padded[b, h, :len(kept[b][h])] = kept[b][h]
    i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    for f, x in (("erank_q", erank_q), ("normalized_q", normalized_q),
                 ("group_sizes_q", i64(uncomp.balanced_group_sizes(Hq, groups_q))), ("groups_q", i64(groups_q_)),
                 ("labels_q", i64(labels)), ("groups_q_vote", i64(vote)), ("budgets_q", i64(budgets_q)),
                 ("erank_kv", erank_kv), ("group_sizes_kv", i64(uncomp.balanced_group_sizes(Hkv, groups_kv))),
                 ("groups_kv", i64(groups_kv_)), ("budgets_kv", i64(budgets_kv)), ("prefill_window", A),
                 ("prefill_scores", pooled), ("prefill_kept", padded), ("prefill_gap", pgap),
                 ("decode_evicted", evicted), ("decode_kept", final), ("decode_gap", dgap)):
        np.save(os.path.join(d_, f"{f}.npy"), x)
    print(f"{name}: N {N}, T {T}, w {w}, groups_q {groups_q_}, budgets_q {budgets_q}, budgets_kv {budgets_kv}, "
          f"{int(np.sum(evicted >= 0))} decode evictions; smallest ranking gap {rank_gap:.1e}, selection gap "
          f"{sel_gap:.1e}")
    return name


def write_uncomp_cases(out, model_dir):
    """Random GQA cases (float32, post-RoPE; per-head anisotropic queries so the entropies differ; redrawn until no
    ranking or selection boundary is a near-tie, 1e-4 relative), plus tinystories-656k's layers when dumped (prompt
    130 tokens, 10 decode steps with the story's own next keys and queries)."""
    rng = np.random.default_rng(20261203)  # separate stream: every case above stays byte-identical
    cases = []
    for name, (B, Hkv, Hq, N, T, d, w), (Mq, Mkv, avg, step) in (
            ("uncomp_gqa_d32", (2, 2, 8, 48, 6, 32, 8), (4, 2, 24, 10)),
            ("uncomp_gqa_d16_m3", (2, 2, 8, 100, 8, 16, 8), (3, 2, 40, 24)),
            ("uncomp_gqa_short", (2, 2, 8, 40, 6, 16, 8), (8, 2, 40, 16)),  # head 0 keeps all and grows
            ("uncomp_kv4_w4", (1, 4, 8, 90, 8, 16, 4), (2, 4, 30, 7))):  # remainders 0.5: ties to the lower head
        written = None
        while written is None:
            alpha = rng.uniform(0.0, 5.0, (1, Hq, 1, 1))
            decay = np.exp(-alpha * np.arange(d) / d)
            q = (rng.standard_normal((B, Hq, N + T, d)) * decay + 0.3 * rng.standard_normal((1, Hq, 1, d))) * 2.5
            k = rng.standard_normal((B, Hkv, N + T, d)) + 0.3 * rng.standard_normal((1, Hkv, 1, d))
            written = write_uncomp_case(out, name, k, q, N, T, w, Mq, Mkv, avg, step, require_gap=1e-4)
        cases.append(written)
    dump = os.path.join(out, "tinystories_dump")
    if model_dir and os.path.exists(os.path.join(model_dir, "model.safetensors")):  # main() has just dumped it
        for layer in sorted(x for x in os.listdir(dump) if x.startswith("layer")):
            ld = os.path.join(dump, layer)
            kk, qq = np.load(os.path.join(ld, "keys.npy")), np.load(os.path.join(ld, "queries.npy"))
            cases.append(write_uncomp_case(out, f"uncomp_tinystories_{layer}", kk[:, :, :140], qq[:, :, :140], 130,
                                           10, 8, 4, 4, 48, 16))
    return cases


def write_uncomp_budget_grid(out):
    """uncomp_budgets/: group sizes, groups and preserving budgets over a grid of (H, M, B̄, Δ, w); entropies on a
    coarse grid so that exact ties occur. Returns the row count."""
    rng = np.random.default_rng(20261204)
    rows, ents, sizes, groups, budgets = [], [], [], [], []
    for H in (1, 4, 7, 8, 28, 32):
        for M in (1, 2, 3, 5, 8):
            if M > H:
                continue
            for avg, step, w in ((384, 73, 8), (100.5, 10.25, 8), (40, 30, 8)):
                e = np.round(rng.uniform(0, 1, H), 1)
                g = uncomp.group_heads(e, M)
                rows.append((H, M, avg, step, w))
                ents.append(e)
                sizes.append(uncomp.balanced_group_sizes(H, M))
                groups.append(g)
                budgets.append(uncomp.head_budgets(avg, M, step, g, w))
    d = os.path.join(out, "uncomp_budgets")
    os.makedirs(d, exist_ok=True)

    def pad(xs, fill, dtype):
        a = np.full((len(xs), 32), fill, dtype=dtype)
        for i, x in enumerate(xs):
            a[i, :len(x)] = x
        return a

    np.save(os.path.join(d, "params.npy"), np.array(rows, dtype=np.float64))
    np.save(os.path.join(d, "entropy.npy"), pad(ents, np.nan, np.float64))
    np.save(os.path.join(d, "sizes.npy"), pad(sizes, -1, np.int64))
    np.save(os.path.join(d, "groups.npy"), pad(groups, -1, np.int64))
    np.save(os.path.join(d, "budgets.npy"), pad(budgets, -1, np.int64))
    return len(rows)


def write_uncomp_vote_grid(out):
    """uncomp_vote/: per-sample entropies (a per-head base plus noise, so the samples disagree; coarse, so ties
    occur), their labels, the majority vote and the mean grouping. Returns the row count."""
    rng = np.random.default_rng(20261205)
    S = 5
    params, ents, labels, votes, means = [], [], [], [], []
    for H, M in ((8, 2), (8, 4), (8, 3), (32, 8), (32, 2), (32, 5), (28, 8), (4, 4)):
        e = np.round(rng.uniform(0, 1, (1, H)) + 0.3 * rng.standard_normal((S, H)), 2)
        lab = [uncomp.group_heads(e[s], M) for s in range(S)]
        params.append((H, M, S))
        ents.append(e)
        labels.append(lab)
        votes.append(uncomp.majority_vote_groups(lab, M))
        means.append(uncomp.group_heads(e.mean(axis=0), M))
    R = len(params)
    d = os.path.join(out, "uncomp_vote")
    os.makedirs(d, exist_ok=True)
    E = np.full((R, S, 32), np.nan)
    Lb = np.full((R, S, 32), -1, dtype=np.int64)
    V = np.full((R, 32), -1, dtype=np.int64)
    Mn = np.full((R, 32), -1, dtype=np.int64)
    for i, (H, _, _) in enumerate(params):
        E[i, :, :H] = ents[i]
        Lb[i, :, :H] = labels[i]
        V[i, :H] = votes[i]
        Mn[i, :H] = means[i]
    np.save(os.path.join(d, "params.npy"), np.array(params, dtype=np.int64))
    np.save(os.path.join(d, "entropy.npy"), E)
    np.save(os.path.join(d, "labels.npy"), Lb)
    np.save(os.path.join(d, "vote.npy"), V)
    np.save(os.path.join(d, "mean.npy"), Mn)
    return R


RDKV_EPS = ("llama31_v", "llama31_k")


RDKV_LADDER = (1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-9, 1e-12)


def rdkv_stability(tw, cw, v, k, Bt, rho, solver, eps_v, eps_k, evict, rng):
    """(V, K) stability of a head's plan: the largest relative perturbation in RDKV_LADDER such that three draws of
    w_u (1 + delta U(-1, 1)) on the token weights (V) or the channel weights (K) leave both bit vectors unchanged
    (0 when even 1e-12 changes them: an exact tie)."""
    out = []
    for which in (0, 1):
        level = 0.0
        for delta in RDKV_LADDER:
            ok = True
            for _ in range(3):
                t = tw * (1 + delta * rng.uniform(-1, 1, tw.shape)) if which == 0 else tw
                c = cw * (1 + delta * rng.uniform(-1, 1, cw.shape)) if which == 1 else cw
                v2, k2 = rdkv.allocate_head(t, c, Bt, rho, solver, eps_v, eps_k, evict)
                ok = ok and np.array_equal(v2, v) and np.array_equal(k2, k)
            if ok:
                level = delta
                break
        out.append(level)
    return out


def write_rdkv_case(out, name, keys, values, queries, qpos, lengths, aq, apos, window, kernel, plans, packs,
                    require_gap=0.0):
    """One RDKV case (format: the module docstring). plans: [(name, solver, budget_tokens, ratio, rho)]; packs:
    [(name, plan, zero_point, v_group, k_group, clamp)]. Returns None, writing nothing, when an exact plan's
    decision gap is below require_gap."""
    keys, values = np.ascontiguousarray(keys, np.float32), np.ascontiguousarray(values, np.float32)
    queries, aq = np.ascontiguousarray(queries, np.float32), np.ascontiguousarray(aq, np.float32)
    k64, v64, q64, a64 = (x.astype(np.float64) for x in (keys, values, queries, aq))
    B, H, N, d = keys.shape
    Hq = queries.shape[1]
    g = Hq // H
    lengths = np.asarray(lengths, dtype=np.int64).reshape(B, H)
    eps_v, eps_k = (rdkv.EPS[e] for e in RDKV_EPS)
    rng = np.random.default_rng(7)  # the stability probes' own stream
    tw = np.zeros((B, H, N))
    cw = np.zeros((B, H, d))
    for b in range(B):
        for h in range(H):
            n = lengths[b, h]
            tw[b, h, :n] = rdkv.token_weights(k64[b, h, :n], q64[b, h * g:(h + 1) * g], np.arange(n), qpos[b],
                                              window, kernel)
            cw[b, h] = rdkv.channel_weights(k64[b, h, :n], q64[b, h * g:(h + 1) * g], window)
    tw32, cw32 = tw.astype(np.float32).astype(np.float64), cw.astype(np.float32).astype(np.float64)
    res = {}
    worst = np.inf
    for pname, solver, budget, ratio, rho, evict in plans:
        vb = np.zeros((B, H, N), dtype=np.int64)
        kb = np.zeros((B, H, d), dtype=np.int64)
        bud = np.zeros((B, H, 2))
        gap = np.full((B, H, 2), np.inf)
        for b in range(B):
            for h in range(H):
                n = lengths[b, h]
                info = {}
                Bt = rdkv.head_budget_tokens(n, budget, ratio)
                v, k = rdkv.allocate_head(tw32[b, h, :n], cw32[b, h], Bt, rho, solver, eps_v, eps_k, evict,
                                          info=info)
                vb[b, h, :n], kb[b, h] = v, k
                floor = solver != "lagrangian"
                bud[b, h] = [math.floor(info["v_budget"]) if floor else info["v_budget"],
                             math.floor(info["k_budget"]) if floor else info["k_budget"]]
                if solver != "dp":  # the DP is compared by its distortion
                    gap[b, h] = rdkv_stability(tw32[b, h, :n], cw32[b, h], v, k, Bt, rho, solver, eps_v, eps_k,
                                               evict, rng)
                if solver == "lagrangian":  # a bisection that never converged ends on a threshold λ: an exact tie
                    gap[b, h] = [0.0 if info[x] < 1e-12 else gap[b, h, i] for i, x in enumerate(("v_gap", "k_gap"))]
        if solver == "exact":
            worst = min(worst, gap.min())
        res[pname] = (vb, kb, bud, gap)
    if worst < require_gap:
        return None
    dd = os.path.join(out, name)
    os.makedirs(dd, exist_ok=True)
    for f, x in (("keys", keys), ("values", values), ("queries", queries), ("query_positions", qpos),
                 ("lengths", lengths), ("attn_queries", aq), ("attn_positions", apos), ("token_weights", tw),
                 ("channel_weights", cw)):
        np.save(os.path.join(dd, f"{f}.npy"), np.asarray(x, dtype=np.int64) if f in (
            "query_positions", "attn_positions", "lengths") else x)
    with open(os.path.join(dd, "meta.txt"), "w") as f:
        f.write(f"window_size {window}\nkernel_size {kernel}\neps_v {RDKV_EPS[0]}\neps_k {RDKV_EPS[1]}\n"
                f"weight_gap {worst:.3e}\n")
    with open(os.path.join(dd, "plans.txt"), "w") as f:
        for pname, solver, budget, ratio, rho, evict in plans:
            f.write(f"{pname} {solver} {budget} {ratio!r} {rho!r} {int(evict)}\n")
            for tag, x in zip(("v_bits", "k_bits", "budgets", "gaps"), res[pname]):
                np.save(os.path.join(dd, f"{tag}_{pname}.npy"), x)
    nq = aq.shape[2]
    notes = []
    with open(os.path.join(dd, "packs.txt"), "w") as f:
        for kname, pname, zp, vg, kg, clamp in packs:
            f.write(f"{kname} {pname} {zp} {vg} {kg} {int(clamp)}\n")
            vb, kb = res[pname][:2]
            pos = np.full((B, H, N), -1, dtype=np.int64)
            kh, vh = np.zeros((B, H, N, d)), np.zeros((B, H, N, d))
            km, vm = np.full((B, H, N, d), np.inf, np.float32), np.full((B, H, N, d), np.inf, np.float32)
            o, lse = np.zeros((B, Hq, nq, d)), np.zeros((B, Hq, nq))
            for b in range(B):
                for h in range(H):
                    n = lengths[b, h]
                    p_, k_, v_, kmar, vmar = rdkv.pack_head(k64[b, h, :n], v64[b, h, :n], np.arange(n), vb[b, h, :n],
                                                          kb[b, h], zp, vg, kg, clamp)
                    T = len(p_)
                    pos[b, h, :T], kh[b, h, :T], vh[b, h, :T] = p_, k_, v_
                    km[b, h, :T], vm[b, h, :T] = kmar, vmar
                    o[b, h * g:(h + 1) * g], lse[b, h * g:(h + 1) * g] = rdkv.attend(
                        a64[b, h * g:(h + 1) * g], apos[b], k_, v_, p_)
            for tag, x in (("positions", pos), ("khat", kh), ("vhat", vh), ("kmargin", km), ("vmargin", vm),
                           ("out", o), ("lse", lse)):
                np.save(os.path.join(dd, f"{tag}_{kname}.npy"), x)
            notes.append(f"{kname} min code margin {min(km.min(), vm.min()):.1e}")
    gaps = ", ".join(f"{p[0]} {res[p[0]][3].min():.0e}" for p in plans)
    kept = ", ".join(f"{p[0]} {int((res[p[0]][0] > 0).sum())}" for p in plans)
    print(f"{name}: lengths {lengths.tolist()}; kept tokens {kept}; plan stability {gaps}; " + "; ".join(notes))
    return name


def rdkv_plans(N):
    """Plans of a case with up to N tokens: two budgets (about N/8 and N/3 tokens), rho 0.5 and 0.25, every
    solver, a ratio budget, and the quant-only ablation (no eviction) at the larger budget."""
    b1, b2 = max(4, N // 8), max(6, N // 3)
    return [(f"exact_b{b1}_rho0.5", "exact", b1, -1.0, 0.5, True),
            (f"lagrangian_b{b1}_rho0.5", "lagrangian", b1, -1.0, 0.5, True),
            (f"exact_b{b2}_rho0.25", "exact", b2, -1.0, 0.25, True),
            (f"lagrangian_b{b2}_rho0.25", "lagrangian", b2, -1.0, 0.25, True),
            (f"dp_b{b1}_rho0.5", "dp", b1, -1.0, 0.5, True), ("exact_ratio0.85_rho0.5", "exact", 0, 0.85, 0.5, True),
            (f"exact_b{b2}_rho0.25_noevict", "exact", b2, -1.0, 0.25, False),
            (f"lagrangian_b{b2}_rho0.25_noevict", "lagrangian", b2, -1.0, 0.25, False)]


def rdkv_packs(plans, d):
    """KIVI arithmetic on the first exact plan, the authors' (integer zero point, K 16 -> 8) on the first
    Lagrangian plan, grouped float-min (V groups of d/2 channels, K groups of 16 tokens) on the second exact plan."""
    return [("kivi", plans[0][0], "float_min", 0, 0, False), ("authors", plans[1][0], "integer", 0, 0, True),
            ("grouped", plans[2][0], "float_min", d // 2, 16, False)]


def write_rdkv_cases(out, model_dir):
    """Random caches (float32; GQA 4 and MHA, d = 16 and 32, N = 40 to 300, per-head lengths differing; keys with
    per-channel scales so the ThinK weights spread; redrawn until every exact plan is stable under 1e-9 relative
    perturbations of its weights), plus tinystories-656k's layers 0 and 1 when dumped (W = 32, the model's own
    post-RoPE queries)."""
    rng = np.random.default_rng(20261213)  # separate stream: every case above stays byte-identical
    cases = []
    for name, (B, H, Hq, N, d, W), lengths in (
            ("rdkv_gqa4_d32", (2, 2, 8, 300, 32, 16), [[300, 271], [233, 300]]),
            ("rdkv_mha_d16", (1, 3, 3, 120, 16, 8), [[120, 97, 64]]),
            ("rdkv_gqa4_d16_short", (2, 2, 8, 40, 16, 8), [[40, 33], [21, 40]]),
            ("rdkv_gqa1_d32", (1, 2, 2, 200, 32, 32), [[200, 151]])):
        written = None
        while written is None:
            scale = np.exp(rng.uniform(-1.0, 1.0, (1, H, 1, d)))
            k = rng.standard_normal((B, H, N, d)) * scale + 0.3 * rng.standard_normal((1, H, 1, d))
            v = rng.standard_normal((B, H, N, d)) * np.exp(rng.uniform(-0.5, 0.5, (B, H, N, 1)))
            q = 1.5 * rng.standard_normal((B, Hq, W + 3, d))
            end = np.max(lengths, axis=1)
            qpos = np.stack([np.arange(e - W, e) for e in end])
            apos = np.stack([np.array([e - W // 2, e - 1, e + 5]) for e in end])
            plans = rdkv_plans(N)
            written = write_rdkv_case(out, name, k, v, q[:, :, :W], qpos, lengths, q[:, :, W:], apos, W, 5, plans,
                                      rdkv_packs(plans, d), require_gap=1e-9)
        cases.append(written)
    dump = os.path.join(out, "tinystories_dump")
    if model_dir and os.path.exists(os.path.join(model_dir, "model.safetensors")):  # main() has just dumped it
        for layer in ("layer0", "layer1"):
            ld = os.path.join(dump, layer)
            if not os.path.isdir(ld):
                continue
            kk, vv = np.load(os.path.join(ld, "keys.npy")), np.load(os.path.join(ld, "values.npy"))
            qq = np.load(os.path.join(ld, "queries.npy"))  # the model's own post-RoPE queries, row i at position i
            B, H, n, d = kk.shape
            W = 32
            rows = np.array([n // 2, n - 20, n - 1])
            plans = rdkv_plans(n)
            cases.append(write_rdkv_case(out, f"rdkv_tinystories_{layer}", kk, vv, qq[:, :, n - W:],
                                         np.broadcast_to(np.arange(n - W, n), (B, W)), np.full((B, H), n),
                                         qq[:, :, rows], np.broadcast_to(rows, (B, 3)), W, 5, plans,
                                         rdkv_packs(plans, d)))
    return cases


def write_pyramid_schedules(out):
    """PyramidKV per-layer totals over a grid of (n, C or ratio, w, beta, L), both behaviours; returns the count."""
    rows, keeps = [], []
    for n in (1, 7, 30, 50, 64, 100, 128, 300, 1000, 2787, 4096, 8000):
        for w in (0, 4, 8, 32, 64):
            for beta in (1, 5, 20):
                for L in (2, 4, 32):
                    for C in (16, 30, 128, 512, 2048):
                        if C > w:
                            rows.append((0, n, C, 0.0, w, beta, L))
                            keeps.append(allocators.pyramid_authors(n, C, w, beta, L))
                    for r in (0.25, 0.5, 0.75):  # the authors' C from a ratio: int(n (1 - r))
                        C = int(n * (1.0 - r))
                        if C > w:
                            rows.append((0, n, 0, r, w, beta, L))
                            keeps.append(allocators.pyramid_authors(n, C, w, beta, L))
                    for r in (0.1, 0.25, 0.5, 0.7, 0.744, 0.9):
                        rows.append((1, n, 0, r, w, beta, L))
                        keeps.append(allocators.pyramid_kvpress(n, r, w, beta, L))
    d = os.path.join(out, "pyramid_kv")
    os.makedirs(d, exist_ok=True)
    keep = np.full((len(keeps), max(len(k) for k in keeps)), -1, dtype=np.int64)
    for i, k in enumerate(keeps):
        keep[i, : len(k)] = k
    np.save(os.path.join(d, "params.npy"), np.array(rows, dtype=np.float64))
    np.save(os.path.join(d, "keep.npy"), keep)
    return len(rows)


if __name__ == "__main__":
    main()
