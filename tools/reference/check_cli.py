# SPDX-License-Identifier: Apache-2.0
"""End-to-end check of the `kvc` CLI against the NumPy oracle on the reference vectors.

Key-only policies, for every case in manifest.txt: `kvc score` must match the oracle's scores (float32 within
1e-5, float16 within 2e-3), and `kvc compress --ratio 0.5` must write the oracle's kept set (tokens whose oracle
scores lie within 1e-5 of the selection boundary may swap), plus keys/values equal to the gathered inputs.

Window-attention policies (SnapKV, TOVA; oracle in baselines.py), for every case in window_manifest.txt and every
oracle variant it holds: `kvc score --policy snap_kv|tova --queries queries.npy --rope theta=T,style=S` with the
variant's parameters must match scores_<variant>.npy within 1e-5 relative to max(1, max|score|) (the queries and
keys are exact in float32, so float16 cases get the same bound), and `kvc compress --ratio R` must keep
kept_<variant>_<R>.npy for every R (boundary ties as above). The snap_kv authors and kvpress variants pass only
`reference` and `window_size`, so they check the documented per-reference defaults, which must also be what
`kvc policies` prints. Per case, explicit --positions equal to the default ones must give identical scores, and
post-RoPE queries (the model's own for tinystories, baselines.rope otherwise) with --param queries=post_rope must
match the oracle.

Stateful policies (Expected Attention, H2O; oracle in expected_attention.py and h2o.py), for every case in
stateful_manifest.txt (S pre-RoPE queries for S post-RoPE keys, query row i at position i, which is the CLI's default
N - S + i): `kvc score --policy expected_attention --param n_future_positions=F --param n_sink=K --values values.npy
--queries queries.npy --rope theta=T,style=S` (F, K, T, S from meta.txt) with each variant's parameter
(STATEFUL_VARIANTS) must match scores_<variant>.npy, `kvc score --policy h2o` scores_h2o_accumulated.npy and with
--param reference=kvpress scores_h2o_kvpress.npy, all within 1e-5 relative to max(1, max|score|) as above.
`kvc compress --policy expected_attention --ratio R` must keep kept_ea_default_<R>.npy, and `kvc compress --policy
h2o --budget hh+recent --param recent_share=recent/(hh+recent)` h2o_kept.npy (the heavy hitters may swap only at
ties among the candidates [0, S - recent) within 1e-5 relative). Explicit --positions 0..S-1 must give each
policy identical scores.

Allocators (AdaKV, PyramidKV; oracle in allocators.py), for every case in manifest.txt: `kvc compress --policy knorm
--allocator ada_kv|pyramid_kv|pyramid_kv+ada_kv` (ALLOCATOR_VARIANTS: both references, alpha 0.2 and 0.5, ratios and
budgets, protected tokens, PyramidKV layers) must keep, per head, exactly the oracle's totals and kept sets computed
on kvc's own Knorm scores (`kvc score`; the scores are checked above, so this checks the allocation, ranking by
score, head, index as both sides do), write the ragged store (offsets.npy the prefix sums of counts.npy,
ragged_keys.npy / ragged_values.npy the kept input rows) and report in --time's JSON the memory of B*H*N input rows,
B*H*max(count) padded rows and sum(count) ragged rows. With tinystories-656k's dump, `kvc compress --dump` (a
meta.json written beside the oracle's layers, RoPE from the window case's meta.txt) must give every layer the
PyramidKV schedule of that layer (pyramid_kv+ada_kv over SnapKV, authors; pyramid_kv over SnapKV, kvpress) on kvc's
own SnapKV scores of the layer, and a total --time line that sums the layers'.
MomentKV (always, on synthetic cases; and on every case of window_manifest.txt): `kvc score --policy moment_kv` must
be alpha_j ||v_j|| (alpha: SnapKV's authors' window vote pooled in aligned chunks, moment_base) and alpha with
mi=false; `kvc compress --policy moment_kv --budget L` must keep per head what a float64 replay of the prefill rounds
keeps (mi_prefill), write the kept input rows and moments equal to those of the evicted rows (evicted_moments; 1e-4,
2e-3 with fp16 storage); `kvc attend` over that cache with --indices and --moments (pre-RoPE decode queries past the
prompt, --rope) must write plain_out/plain_lse/out/lse equal to the spec's formula evaluated in float64 from the
files (corrected_attention; 1e-4 relative), for order=first and order=zeroth.
Usage: check_cli.py KVC_BINARY VECTORS_DIR WORK_DIR
"""
import json
import os
import re
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("SKIPPED: NumPy is not installed")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import allocators  # noqa: E402
import baselines  # noqa: E402

# oracle variant (make_vectors.WINDOW_VARIANTS) -> CLI policy and parameters; window_size comes from meta.txt
WINDOW_VARIANTS = {
    "snap_kv_authors": ("snap_kv", {"reference": "authors"}),  # defaults: kernel 7, max pooling, gqa mean
    "snap_kv_kvpress": ("snap_kv", {"reference": "kvpress"}),  # defaults: kernel 5, avg pooling, gqa mean
    "snap_kv_authors_avg_sum": ("snap_kv", {"kernel_size": 5, "pooling": "avg", "gqa": "sum"}),
    "snap_kv_authors_pqh": ("snap_kv", {"gqa": "per_query_head"}),
    "tova_authors": ("tova", {}),
    "tova_kvpress": ("tova", {"reference": "kvpress"}),
}
RATIOS = ("0.25", "0.5", "0.75")
# oracle variant (make_vectors.STATEFUL_VARIANTS) -> CLI policy and parameters; every expected_attention run also
# passes n_future_positions and n_sink from meta.txt
STATEFUL_VARIANTS = {
    "ea_default": ("expected_attention", {}),  # defaults: epsilon 0.01, covariance, vnorm, gqa mean, sinks outside
    "ea_eps0": ("expected_attention", {"epsilon": 0}),
    "ea_nocov": ("expected_attention", {"use_covariance": "false"}),
    "ea_novnorm": ("expected_attention", {"use_vnorm": "false"}),
    "ea_gqa_max": ("expected_attention", {"gqa": "max"}),
    "ea_sinks_normalized": ("expected_attention", {"normalize_sinks": "true"}),
    "h2o_accumulated": ("h2o", {}),  # reference=authors: raw accumulated attention
    "h2o_kvpress": ("h2o", {"reference": "kvpress"}),  # ObservedAttention
}


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {r.returncode}: {r.stderr}")
    return r.stdout


def check_kept(label, od, ref, scores, keys, values, tie_tol):
    """The kept indices in `od` equal `ref` per head up to boundary ties; keys/values are the kept input rows.
    Returns the number of heads whose kept set differs at a tie."""
    idx = np.load(os.path.join(od, "indices.npy"))
    if idx.shape != ref.shape:
        sys.exit(f"FAILED: {label} kept shape {idx.shape}, oracle {ref.shape}")
    kk, vv = np.load(os.path.join(od, "keys.npy")), np.load(os.path.join(od, "values.npy"))
    ties = 0
    for b in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            diff = set(idx[b, h]) ^ set(ref[b, h])
            if diff and scores is not None:
                s = scores[b, h]
                boundary = np.sort(s)[::-1][len(ref[b, h]) - 1]
                if max(abs(s[list(diff)] - boundary)) > tie_tol:
                    sys.exit(f"FAILED: {label} head ({b},{h}) kept set differs: {sorted(diff)}")
                ties += 1
            elif diff:
                sys.exit(f"FAILED: {label} head ({b},{h}) kept set differs: {sorted(diff)}")
            if not np.array_equal(kk[b, h], keys[b, h, idx[b, h]]):
                sys.exit(f"FAILED: {label} compressed keys are not the kept input rows")
            if not np.array_equal(vv[b, h], values[b, h, idx[b, h]]):
                sys.exit(f"FAILED: {label} compressed values are not the kept input rows")
    return ties


def check_key_policies(kvc, vectors, work):
    checked = 0
    for case in open(os.path.join(vectors, "manifest.txt")).read().split():
        d = os.path.join(vectors, case)
        keys = np.load(os.path.join(d, "keys.npy"))
        values = np.load(os.path.join(d, "values.npy"))
        tol = 2e-3 if keys.dtype == np.float16 else 1e-5
        for policy in ("key_diff", "knorm"):
            out = os.path.join(work, f"{case}_{policy}_scores.npy")
            run([kvc, "score", "--policy", policy, "--keys", os.path.join(d, "keys.npy"), "--out", out])
            got, ref = np.load(out), np.load(os.path.join(d, f"scores_{policy}.npy"))
            err = np.abs(got - ref).max() / (1 if policy == "key_diff" else max(1.0, np.abs(ref).max()))
            if not err <= tol:
                sys.exit(f"FAILED: {case} {policy} scores differ from the oracle by {err}")
            checked += 1
        for policy in ("key_diff", "knorm", "streaming_llm"):
            od = os.path.join(work, f"{case}_{policy}_compressed")
            run([kvc, "compress", "--policy", policy, "--ratio", "0.5", "--keys", os.path.join(d, "keys.npy"),
                 "--values", os.path.join(d, "values.npy"), "--out-dir", od])
            scores = None if policy == "streaming_llm" else np.load(os.path.join(d, f"scores_{policy}.npy"))
            check_kept(f"{case} {policy}", od, np.load(os.path.join(d, f"kept_{policy}_0.5.npy")), scores, keys,
                       values, 1e-5)
            checked += 1
    return checked


def check_documented_defaults(kvc):
    """`kvc policies` prints SnapKV's per-reference defaults as the oracle's SNAP_KV_DEFAULTS."""
    text = run([kvc, "policies"])
    for i, name in enumerate(("window_size", "kernel_size", "pooling")):
        m = re.search(rf"--param {name}=(\S+) \(kvpress: (\S+)\)", text)
        expected = tuple(str(baselines.SNAP_KV_DEFAULTS[r][i]) for r in ("authors", "kvpress"))
        if not m or m.groups() != expected:
            sys.exit(f"FAILED: `kvc policies` shows {name} defaults {m and m.groups()}, the oracle's are {expected}")


def read_meta(d):
    meta = dict(line.split(None, 1) for line in open(os.path.join(d, "meta.txt")).read().splitlines() if line)
    return int(meta["window_size"]), float(meta["theta"]), meta["style"].strip()


def check_window_policies(kvc, vectors, work):
    check_documented_defaults(kvc)
    checked = 0
    for case in open(os.path.join(vectors, "window_manifest.txt")).read().split():
        d = os.path.join(vectors, case)
        w, theta, style = read_meta(d)
        keys = np.load(os.path.join(d, "keys.npy"))
        values = np.load(os.path.join(d, "values.npy"))
        queries = np.load(os.path.join(d, "queries.npy"))
        n = keys.shape[2]
        files = ["--keys", os.path.join(d, "keys.npy"), "--queries", os.path.join(d, "queries.npy")]
        rope = ["--rope", f"theta={theta:g},style={style}"]
        for variant, (policy, params) in WINDOW_VARIANTS.items():
            if not os.path.exists(os.path.join(d, f"scores_{variant}.npy")):
                continue
            if policy == "snap_kv":
                params = dict(params, window_size=w)
            args = [a for k, v in params.items() for a in ("--param", f"{k}={v}")] + files + rope
            ref = np.load(os.path.join(d, f"scores_{variant}.npy"))
            scale = max(1.0, np.abs(ref).max())
            out = os.path.join(work, f"{case}_{variant}_scores.npy")
            run([kvc, "score", "--policy", policy] + args + ["--out", out])
            err = np.abs(np.load(out) - ref).max() / scale
            if not err <= 1e-5:
                sys.exit(f"FAILED: {case} {variant} scores differ from the oracle by {err} (relative)")
            checked += 1
            for r in RATIOS:
                od = os.path.join(work, f"{case}_{variant}_{r}")
                run([kvc, "compress", "--policy", policy, "--ratio", r] + args +
                    ["--values", os.path.join(d, "values.npy"), "--out-dir", od])
                check_kept(f"{case} {variant} ratio {r}", od, np.load(os.path.join(d, f"kept_{variant}_{r}.npy")),
                           ref, keys, values, 1e-5 * scale)
                checked += 1

        # Explicit --positions equal to the default ones (N - w + i) change nothing.
        base = ["--policy", "snap_kv", "--param", f"window_size={w}"] + files
        default = os.path.join(work, f"{case}_default.npy")
        run([kvc, "score"] + base + rope + ["--out", default])
        positions = os.path.join(work, f"{case}_positions.npy")
        b, w_rows = queries.shape[0], queries.shape[2]
        np.save(positions, np.broadcast_to(np.arange(n - w_rows, n), (b, w_rows)).copy())
        explicit = os.path.join(work, f"{case}_explicit.npy")
        run([kvc, "score"] + base + rope + ["--positions", positions, "--out", explicit])
        if not np.array_equal(np.load(default), np.load(explicit)):
            sys.exit(f"FAILED: {case}: --positions N - w + i changes the scores")
        # Post-RoPE queries used as given: the model's own rotated queries for real cases, else baselines.rope.
        layer = os.path.join(vectors, "tinystories_dump", case.replace("tinystories_", ""), "queries.npy")
        if case.startswith("tinystories_") and os.path.exists(layer):
            post = np.load(layer)[:, :, n - w_rows:].astype(np.float32)
        else:
            post = baselines.rope(queries, np.arange(n - w_rows, n), theta, style).astype(np.float32)
        post_file = os.path.join(work, f"{case}_post_rope.npy")
        np.save(post_file, post)
        out = os.path.join(work, f"{case}_post_rope_scores.npy")
        run([kvc, "score", "--policy", "snap_kv", "--param", f"window_size={w}", "--param", "queries=post_rope",
             "--keys", os.path.join(d, "keys.npy"), "--queries", post_file, "--out", out])
        ref = np.load(os.path.join(d, "scores_snap_kv_authors.npy"))
        err = np.abs(np.load(out) - ref).max() / max(1.0, np.abs(ref).max())
        if not err <= 1e-5:
            sys.exit(f"FAILED: {case}: post-RoPE queries (queries=post_rope) differ from the oracle by {err}")
        checked += 2
    return checked


def read_stateful_meta(d):
    meta = dict(line.split(None, 1) for line in open(os.path.join(d, "meta.txt")).read().splitlines() if line)
    return {k: (v.strip() if k == "style" else float(v) if k == "theta" else int(v)) for k, v in meta.items()}


def h2o_recent_share(hh, recent):
    """recent/(hh + recent), nudged up where the double product floors below `recent` (the CLI protects
    floor(recent_share x budget) recent tokens)."""
    share = recent / (hh + recent)
    if int(share * (hh + recent)) < recent:
        share = float(np.nextafter(share, 1.0))
    assert int(share * (hh + recent)) == recent
    return repr(share)


def check_stateful_policies(kvc, vectors, work):
    checked = 0
    worst = {}  # variant -> (worst relative score error, case); and the heads kept differently at ties
    ties = {"ea_default kept": 0, "h2o kept": 0}
    for case in open(os.path.join(vectors, "stateful_manifest.txt")).read().split():
        d = os.path.join(vectors, case)
        meta = read_stateful_meta(d)
        keys = np.load(os.path.join(d, "keys.npy"))
        values = np.load(os.path.join(d, "values.npy"))
        queries = np.load(os.path.join(d, "queries.npy"))
        n = keys.shape[2]
        if queries.shape[2] != n:
            sys.exit(f"FAILED: {case}: {queries.shape[2]} query rows for {n} keys (the vectors are inconsistent)")
        files = ["--keys", os.path.join(d, "keys.npy"), "--queries", os.path.join(d, "queries.npy")]
        rope = ["--rope", f"theta={meta['theta']:g},style={meta['style']}"]
        ea = {"n_future_positions": meta["n_future_positions"], "n_sink": meta["n_sink"]}

        def args_of(policy, params):
            params = dict(ea, **params) if policy == "expected_attention" else params
            extra = ["--values", os.path.join(d, "values.npy")] if policy == "expected_attention" else []
            return [a for k, v in params.items() for a in ("--param", f"{k}={v}")] + files + extra + rope

        for variant, (policy, params) in STATEFUL_VARIANTS.items():
            ref = np.load(os.path.join(d, f"scores_{variant}.npy"))
            scale = max(1.0, np.abs(ref).max())
            out = os.path.join(work, f"{case}_{variant}_scores.npy")
            run([kvc, "score", "--policy", policy] + args_of(policy, params) + ["--out", out])
            got = np.load(out)
            if got.shape != ref.shape:
                sys.exit(f"FAILED: {case} {variant} scores have shape {got.shape}, the oracle's {ref.shape}")
            err = np.abs(got - ref).max() / scale
            worst[variant] = max(worst.get(variant, (0.0, "")), (err, case))
            if not err <= 1e-5:
                sys.exit(f"FAILED: {case} {variant} scores differ from the oracle by {err} (relative)")
            checked += 1
            if variant == "ea_default":
                for r in RATIOS:
                    od = os.path.join(work, f"{case}_{variant}_{r}")
                    run([kvc, "compress", "--policy", policy, "--ratio", r] + args_of(policy, params) +
                        ["--out-dir", od])
                    ties["ea_default kept"] += check_kept(f"{case} {variant} ratio {r}", od,
                                                          np.load(os.path.join(d, f"kept_{variant}_{r}.npy")), ref,
                                                          keys, values, 1e-5 * scale)
                    checked += 1
            if variant == "h2o_accumulated":
                # H2O's keep rule: the last `recent` slots, then the top hh of the candidates [0, S - recent). The
                # recent slots get +inf for the tie rule, so the boundary is the hh-th best candidate and a recent
                # slot left out fails.
                hh, recent = meta["hh"], meta["recent"]
                od = os.path.join(work, f"{case}_h2o_kept")
                run([kvc, "compress", "--policy", "h2o", "--budget", str(hh + recent), "--param",
                     f"recent_share={h2o_recent_share(hh, recent)}"] + args_of(policy, params) +
                    ["--values", os.path.join(d, "values.npy"), "--out-dir", od])
                tie_scores = ref.copy()
                tie_scores[..., n - recent:] = np.inf
                ties["h2o kept"] += check_kept(f"{case} h2o budget {hh}+{recent}", od,
                                               np.load(os.path.join(d, "h2o_kept.npy")), tie_scores, keys, values,
                                               1e-5 * scale)
                checked += 1

        # The default query positions are N - S + i = i: explicit --positions 0..S-1 change nothing.
        positions = os.path.join(work, f"{case}_positions.npy")
        np.save(positions, np.broadcast_to(np.arange(n, dtype=np.int64), (queries.shape[0], n)).copy())
        for policy in ("expected_attention", "h2o"):
            default = os.path.join(work, f"{case}_{policy}_scores.npy")
            run([kvc, "score", "--policy", policy] + args_of(policy, {}) + ["--out", default])
            explicit = os.path.join(work, f"{case}_{policy}_explicit.npy")
            run([kvc, "score", "--policy", policy] + args_of(policy, {}) + ["--positions", positions, "--out",
                                                                            explicit])
            if not np.array_equal(np.load(default), np.load(explicit)):
                sys.exit(f"FAILED: {case} {policy}: --positions 0..S-1 change the scores")
            checked += 1
    print("stateful CLI scores, worst error relative to max(1, max|score|): " +
          ", ".join(f"{v} {e:.1e} ({c})" for v, (e, c) in worst.items()))
    print("heads kept differently at a tie: " + ", ".join(f"{k} {n}" for k, n in ties.items()))
    return checked


# (allocator, parameters, budget option): knorm's scores; n_sink / n_recent are knorm's own selection parameters
ALLOCATOR_VARIANTS = (
    ("ada_kv", {}, ("--ratio", "0.5")),
    ("ada_kv", {"alpha_safeguard": "0.5", "n_sink": "2", "n_recent": "4"}, ("--budget", "64")),
    ("ada_kv", {"reference": "kvpress"}, ("--ratio", "0.75")),
    ("ada_kv", {"reference": "kvpress", "alpha_safeguard": "0.5", "n_recent": "3"}, ("--budget", "40")),
    ("pyramid_kv", {"layer": "1", "num_layers": "4"}, ("--budget", "100")),
    ("pyramid_kv", {"layer": "3", "num_layers": "4", "beta": "5", "window_size": "4"}, ("--ratio", "0.5")),
    ("pyramid_kv", {"reference": "kvpress", "layer": "2", "num_layers": "4", "window_size": "4"}, ("--ratio", "0.7")),
    ("pyramid_kv+ada_kv", {"layer": "0", "num_layers": "3"}, ("--budget", "120")),
    ("pyramid_kv+ada_kv", {"reference": "kvpress", "layer": "5", "num_layers": "8", "window_size": "16"},
     ("--ratio", "0.6")),
)


def run_full(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {r.returncode}: {r.stderr}")
    return r.stdout, r.stderr


def time_lines(stderr):
    """The --time JSON lines of a compress run."""
    return [json.loads(line) for line in stderr.splitlines() if line.startswith('{"command":"compress"')]


def expected_allocation(scores, alloc, params, budget):
    """The oracle's per-head totals and kept index lists for scores [B, H, N] (every head holds N tokens)."""
    B, H, N = scores.shape
    reference = params.get("reference", "authors")
    kvpress = reference == "kvpress"
    option, value = budget
    if "pyramid_kv" in alloc:
        w = int(params.get("window_size", 64 if kvpress else 8))
        beta, layers, layer = int(params.get("beta", 20)), int(params["num_layers"]), int(params["layer"])
        if kvpress:
            def keep(n):
                return allocators.pyramid_kvpress(n, float(value), w, beta, layers)[layer]
        else:
            def keep(n):
                capacity = int(value) if option == "--budget" else int(n * (1.0 - float(value)))
                return allocators.pyramid_authors(n, capacity, w, beta, layers)[layer]
    else:
        w = 0
        keep = allocators.fixed_keep(int(value)) if option == "--budget" else allocators.ratio_keep(float(value))
    n_sink = int(params.get("n_sink", 0))
    # the authors' window sits on top of the budget (protected); kvpress's is inside it (here: no window)
    n_recent = max(int(params.get("n_recent", 0)), 0 if kvpress else w)
    s64 = scores.astype(np.float64).tolist()
    lengths = [[N] * H for _ in range(B)]
    if "ada_kv" in alloc:
        alpha = float(params.get("alpha_safeguard", 0.2))
        totals = allocators.ada_kv_allocate(s64, lengths, keep, alpha, reference, n_sink, n_recent)
    else:
        totals = [[keep(N)] * H for _ in range(B)]
    return allocators.ada_kv_kept(s64, lengths, totals, n_sink, n_recent)


def check_compressed(label, od, kept, keys, values, memory):
    """counts/indices equal the oracle's kept lists, keys/values/ragged store hold the kept rows, and the --time
    memory (a dict) is that of the input, padded and ragged rows."""
    B, H, N = keys.shape[:3]
    counts, idx = np.load(os.path.join(od, "counts.npy")), np.load(os.path.join(od, "indices.npy"))
    want = np.array([[len(kept[b][h]) for h in range(H)] for b in range(B)], dtype=np.int64)
    if not np.array_equal(counts, want):
        sys.exit(f"FAILED: {label}: counts {counts.tolist()}, the oracle's {want.tolist()}")
    kk, vv = np.load(os.path.join(od, "keys.npy")), np.load(os.path.join(od, "values.npy"))
    offsets = np.load(os.path.join(od, "offsets.npy"))
    rk, rv = np.load(os.path.join(od, "ragged_keys.npy")), np.load(os.path.join(od, "ragged_values.npy"))
    if not np.array_equal(offsets, np.concatenate([[0], np.cumsum(counts.ravel())])):
        sys.exit(f"FAILED: {label}: offsets.npy {offsets.tolist()} is not the prefix sum of the counts")
    if rk.shape != (counts.sum(), keys.shape[3]) or rv.shape != (counts.sum(), values.shape[3]):
        sys.exit(f"FAILED: {label}: ragged store shapes {rk.shape}, {rv.shape}")
    for b in range(B):
        for h in range(H):
            c, i = counts[b, h], b * H + h
            if list(idx[b, h, :c]) != list(kept[b][h]) or (idx[b, h, c:] != -1).any():
                sys.exit(f"FAILED: {label}: head ({b},{h}) keeps {idx[b, h, :c].tolist()}, the oracle {kept[b][h]}")
            rows = idx[b, h, :c]
            if not (np.array_equal(kk[b, h, :c], keys[b, h, rows]) and
                    np.array_equal(vv[b, h, :c], values[b, h, rows])):
                sys.exit(f"FAILED: {label}: keys.npy/values.npy of head ({b},{h}) are not the kept input rows")
            if not (np.array_equal(rk[offsets[i]:offsets[i + 1]], keys[b, h, rows]) and
                    np.array_equal(rv[offsets[i]:offsets[i + 1]], values[b, h, rows])):
                sys.exit(f"FAILED: {label}: the ragged store of head ({b},{h}) is not its kept input rows")
    row = keys.shape[3] * keys.itemsize + values.shape[3] * values.itemsize
    want_memory = {"row_bytes": row, "input_bytes": B * H * N * row, "padded_bytes": B * H * int(counts.max()) * row,
                   "ragged_bytes": int(counts.sum()) * row, "input_tokens": B * H * N,
                   "kept_tokens": int(counts.sum())}
    got = {k: memory.get(k) for k in want_memory}
    if got != want_memory:
        sys.exit(f"FAILED: {label}: --time memory {got}, expected {want_memory}")


def check_allocators(kvc, vectors, work):
    checked = 0
    for case in open(os.path.join(vectors, "manifest.txt")).read().split():
        d = os.path.join(vectors, case)
        keys = np.load(os.path.join(d, "keys.npy"))
        values = np.load(os.path.join(d, "values.npy"))
        files = ["--keys", os.path.join(d, "keys.npy"), "--values", os.path.join(d, "values.npy")]
        scores_file = os.path.join(work, f"{case}_alloc_knorm.npy")
        run([kvc, "score", "--policy", "knorm", "--keys", os.path.join(d, "keys.npy"), "--out", scores_file])
        scores = np.load(scores_file)
        for i, (alloc, params, budget) in enumerate(ALLOCATOR_VARIANTS):
            label = f"{case} {alloc} {params} {' '.join(budget)}"
            od = os.path.join(work, f"{case}_alloc_{i}")
            args = [a for k, v in params.items() for a in ("--param", f"{k}={v}")]
            _, err = run_full([kvc, "compress", "--policy", "knorm", "--allocator", alloc, *budget, *args, *files,
                               "--out-dir", od, "--time"])
            lines = time_lines(err)
            if len(lines) != 1:
                sys.exit(f"FAILED: {label}: expected one --time line, got {err!r}")
            check_compressed(label, od, expected_allocation(scores, alloc, params, budget), keys, values, lines[0])
            checked += 1
    return checked


def check_dump(kvc, vectors, work):
    """kvc compress --dump over tinystories-656k's layers (the oracle's dump with a meta.json beside it)."""
    src = os.path.join(vectors, "tinystories_dump")
    meta_case = os.path.join(vectors, "tinystories_layer0", "meta.txt")
    if not os.path.isdir(src) or not os.path.exists(meta_case):
        print("note: no tinystories dump: the --dump CLI check skipped")
        return 0
    _, theta, style = read_meta(os.path.dirname(meta_case))
    layers = sorted(int(x[5:]) for x in os.listdir(src) if x.startswith("layer"))
    if layers != list(range(len(layers))):
        sys.exit(f"FAILED: {src}: layer folders {layers} are not layer0 .. layer{len(layers) - 1}")
    dump = os.path.join(work, "tinystories_dump")
    os.makedirs(dump, exist_ok=True)
    k0 = np.load(os.path.join(src, "layer0", "keys.npy"))
    q0 = np.load(os.path.join(src, "layer0", "queries_prerope.npy"))
    for layer in layers:
        link = os.path.join(dump, f"layer{layer}")
        if not os.path.lexists(link):
            os.symlink(os.path.abspath(os.path.join(src, f"layer{layer}")), link)
    with open(os.path.join(dump, "meta.json"), "w") as f:
        json.dump({"model": "tinystories-656k (oracle dump)", "tokens": k0.shape[2], "layers": len(layers),
                   "query_heads": q0.shape[1], "kv_heads": k0.shape[1], "head_dim": k0.shape[3],
                   "rope": {"theta": theta, "style": style, "scaled": False}}, f)
    checked = 0
    for alloc, params, budget, snap in (
            ("pyramid_kv+ada_kv", {}, ("--budget", "48"), ["--param", "window_size=8"]),
            ("pyramid_kv", {"reference": "kvpress"}, ("--ratio", "0.5"),
             ["--param", "reference=kvpress", "--param", "window_size=64"])):
        od = os.path.join(work, f"dump_{alloc}")
        args = [a for k, v in params.items() for a in ("--param", f"{k}={v}")]
        _, err = run_full([kvc, "compress", "--policy", "snap_kv", "--allocator", alloc, *budget, *args, "--dump", dump,
                           "--out-dir", od, "--time"])
        lines = time_lines(err)
        per_layer = [x for x in lines if "layer" in x]
        total = [x for x in lines if "layers" in x]
        if len(per_layer) != len(layers) or len(total) != 1 or total[0]["layers"] != len(layers):
            sys.exit(f"FAILED: --dump {alloc}: expected {len(layers)} layer lines and a total, got {err!r}")
        for key in ("input_bytes", "padded_bytes", "ragged_bytes", "input_tokens", "kept_tokens"):
            if total[0][key] != sum(x[key] for x in per_layer):
                sys.exit(f"FAILED: --dump {alloc}: the total's {key} is not the sum of the layers'")
        for layer in layers:
            ld = os.path.join(src, f"layer{layer}")
            scores_file = os.path.join(work, f"dump_scores_{layer}.npy")
            run([kvc, "score", "--policy", "snap_kv", *snap, "--keys", os.path.join(ld, "keys.npy"), "--queries",
                 os.path.join(ld, "queries_prerope.npy"), "--rope", f"theta={theta:g},style={style}", "--out",
                 scores_file])
            layer_params = dict(params, layer=str(layer), num_layers=str(len(layers)))
            kept = expected_allocation(np.load(scores_file), alloc, layer_params, budget)
            if per_layer[layer]["layer"] != layer:
                sys.exit(f"FAILED: --dump {alloc}: --time lines out of layer order")
            check_compressed(f"--dump {alloc} layer {layer}", os.path.join(od, f"layer{layer}"), kept,
                             np.load(os.path.join(ld, "keys.npy")), np.load(os.path.join(ld, "values.npy")),
                             per_layer[layer])
            checked += 1
    return checked


# --- MomentKV: compress --policy moment_kv (its moments), score with empty moments, and kvc attend -------------------

def chunk_mean(x, k):
    """MomentKV's pooling: each slot gets the mean of its aligned chunk [c k, (c + 1) k) (a last partial chunk
    averages its own slots)."""
    out = np.empty_like(x)
    n = x.shape[-1]
    for c0 in range(0, n, k):
        out[..., c0:c0 + k] = x[..., c0:c0 + k].mean(axis=-1, keepdims=True)
    return out


def moment_base(keys, queries, w, kernel, theta, style):
    """The base score alpha [B, Hkv, N]: SnapKV's authors' vote (window sum, group mean) pooled in aligned chunks;
    the window's own tokens score max(prefix) + 1."""
    logits = baselines.window_logits(queries[:, :, queries.shape[2] - w:], keys, None, theta, style)
    p = baselines.causal_softmax(logits)
    n = keys.shape[2]
    prefix = baselines.reduce_group(p[..., : n - w].sum(axis=2), keys.shape[1], "mean")
    return baselines.protect_tail(chunk_mean(prefix, kernel), w)


def evicted_moments(keys, values, evicted):
    """(n, k_mean, v_mean, C = sum (v - v_mean)(k - k_mean)^T) of the rows `evicted`, in float64 (spec §2.2)."""
    k = keys[evicted].astype(np.float64)
    v = values[evicted].astype(np.float64)
    n = len(evicted)
    if n == 0:
        return 0, np.zeros(keys.shape[-1]), np.zeros(values.shape[-1]), np.zeros((values.shape[-1], keys.shape[-1]))
    km, vm = k.mean(axis=0), v.mean(axis=0)
    return n, km, vm, (v - vm).T @ (k - km)


def mi_prefill(keys, values, alpha, budget, n_sink, n_recent, rounds, tau=1e-6):
    """The prefill rounds of spec §9.1 for one head, in float64: each round scores alpha_j ||r_j|| under the moments
    of the tokens evicted so far, keeps n - ceil((n - L) / rounds_left) with the first n_sink and last n_recent slots
    protected, and folds the rest in. Returns the kept original slots."""
    d = keys.shape[-1]
    c = 1.0 / np.sqrt(d)
    slots = np.arange(keys.shape[0])
    evicted = []
    for left in range(rounds, 0, -1):
        n = len(slots)
        if n <= budget:
            continue
        keep = n - (n - budget + left - 1) // left
        ne, km, vm, cm = evicted_moments(keys, values, evicted)
        v = values[slots].astype(np.float64)
        if ne:
            ct = np.where(np.abs(cm) < tau, 0.0, cm)
            r = v - vm - (c / ne) * keys[slots].astype(np.float64) @ ct.T
        else:
            r = v
        score = alpha[slots] * np.linalg.norm(r, axis=1)
        protected = np.zeros(n, dtype=bool)
        protected[:min(n_sink, n)] = True
        protected[max(0, n - n_recent):] = True
        order = sorted(range(n), key=lambda j: (not protected[j], -score[j], j))
        kept = np.sort(np.array(order[:keep], dtype=np.int64))
        evicted += [int(s) for s in np.setdiff1d(slots, slots[kept])]
        slots = slots[kept]
    return slots


def corrected_attention(q, keys, values, kept_pos, q_pos, moments, order="first", tau=1e-6):
    """The spec's §2.6 formula for one query row q over one KV head's kept rows (causal by position) and the
    moments (n, k_mean, v_mean, C) of its evicted set: returns (plain out, plain lse, corrected out, corrected lse)."""
    c = 1.0 / np.sqrt(q.shape[-1])
    q = q.astype(np.float64)
    visible = kept_pos <= q_pos
    s = c * keys[visible].astype(np.float64) @ q
    if s.size:
        lse_r = np.log(np.exp(s - s.max()).sum()) + s.max()
        o_r = np.exp(s - lse_r) @ values[visible].astype(np.float64)
    else:
        lse_r, o_r = -np.inf, np.zeros(values.shape[-1])
    n, km, vm, cm = moments
    if n == 0:
        return o_r, lse_r, o_r, lse_r
    f_e = vm + ((c / n) * np.where(np.abs(cm) < tau, 0.0, cm) @ q if order == "first" else 0.0)
    lse_e = np.log(n) + c * q @ km
    lse = np.logaddexp(lse_r, lse_e)
    w_r = 0.0 if lse_r == -np.inf else np.exp(lse_r - lse)
    return o_r, lse_r, w_r * o_r + np.exp(lse_e - lse) * f_e, lse


def check_moment_case(kvc, work, label, keys, values, queries, w, theta, style, budget, extra):
    """One case: score (empty moments), compress (kept set against mi_prefill, moments against the evicted rows),
    attend (plain and corrected against corrected_attention), with pre-RoPE decode queries. Returns checks run."""
    checked = 0
    d = os.path.join(work, f"moment_{label}")
    os.makedirs(d, exist_ok=True)
    files = {"keys": keys, "values": values, "queries": queries}
    for name, x in files.items():
        np.save(os.path.join(d, f"{name}.npy"), x)
    b_, h_, n, dk = keys.shape
    params = {"window_size": w, **extra}
    rope = ["--rope", f"theta={theta:g},style={style}"]
    args = [a for k, v in params.items() for a in ("--param", f"{k}={v}")]
    io = ["--keys", os.path.join(d, "keys.npy"), "--values", os.path.join(d, "values.npy"),
          "--queries", os.path.join(d, "queries.npy")] + rope
    kernel = int(params.get("kernel_size", 4))
    alpha = moment_base(keys, queries, w, kernel, theta, style)

    # kvc score: alpha_j ||v_j|| (empty moments); mi=false: alpha alone.
    score_args = [a for k, v in params.items() if k not in ("n_sink", "n_recent") for a in ("--param", f"{k}={v}")]
    for mi in ("true", "false"):
        out = os.path.join(d, f"score_{mi}.npy")
        run([kvc, "score", "--policy", "moment_kv", "--param", f"mi={mi}"] + score_args + io + ["--out", out])
        ref = alpha * (np.linalg.norm(values.astype(np.float64), axis=-1) if mi == "true" else 1.0)
        err = np.abs(np.load(out) - ref).max() / max(1.0, np.abs(ref).max())
        if not err <= 1e-5:
            sys.exit(f"FAILED: moment_kv {label}: kvc score mi={mi} differs from the oracle by {err} (relative)")
        checked += 1

    n_sink, n_recent = int(params.get("n_sink", 1)), int(params.get("n_recent", 32))
    rounds = int(params.get("prefill_rounds", 8))
    od = os.path.join(d, "compressed")
    run([kvc, "compress", "--policy", "moment_kv", "--budget", str(budget)] + args + io + ["--out-dir", od])
    idx, counts = np.load(os.path.join(od, "indices.npy")), np.load(os.path.join(od, "counts.npy"))
    kk, vv = np.load(os.path.join(od, "keys.npy")), np.load(os.path.join(od, "values.npy"))
    mfiles = [np.load(os.path.join(od, f"moment_{m}.npy")) for m in ("count", "key_mean", "value_mean", "comoment")]
    if mfiles[3].shape != (b_, h_, values.shape[-1], dk) or mfiles[0].dtype != np.int64:
        sys.exit(f"FAILED: moment_kv {label}: moment files of shapes {[m.shape for m in mfiles]}")
    storage_tol = 2e-3 if params.get("storage") == "fp16" else 1e-4
    for b in range(b_):
        for h in range(h_):
            c = counts[b, h]
            kept = idx[b, h, :c]
            want = mi_prefill(keys[b, h], values[b, h], alpha[b, h], budget, n_sink, n_recent, rounds)
            if not np.array_equal(kept, want):
                sys.exit(f"FAILED: moment_kv {label} head ({b},{h}) keeps {kept.tolist()}, the oracle {want.tolist()}")
            if not (np.array_equal(kk[b, h, :c], keys[b, h, kept]) and
                    np.array_equal(vv[b, h, :c], values[b, h, kept])):
                sys.exit(f"FAILED: moment_kv {label} head ({b},{h}): keys.npy/values.npy are not the kept input rows")
            ne, km, vm, cm = evicted_moments(keys[b, h], values[b, h], np.setdiff1d(np.arange(n), kept))
            if mfiles[0][b, h] != ne:
                sys.exit(f"FAILED: moment_kv {label} head ({b},{h}): moment_count {mfiles[0][b, h]}, evicted {ne}")
            for got, ref, name in ((mfiles[1][b, h], km, "key_mean"), (mfiles[2][b, h], vm, "value_mean"),
                                   (mfiles[3][b, h], cm, "comoment")):
                err = np.abs(got.astype(np.float64) - ref).max() / max(1.0, np.abs(ref).max())
                if not err <= storage_tol:
                    sys.exit(f"FAILED: moment_kv {label} head ({b},{h}): moment_{name} differs from the evicted rows' "
                             f"by {err} (relative)")
            checked += 2

    # kvc attend: decode queries (pre-RoPE, rotated with --rope) at positions n .. n + 2 over the compressed cache.
    rng = np.random.default_rng(7)
    hq = queries.shape[1]
    dq = rng.standard_normal((b_, hq, 3, dk)).astype(np.float32)
    pos = np.broadcast_to(np.arange(n, n + 3), (b_, 3)).astype(np.int64).copy()
    np.save(os.path.join(d, "decode.npy"), dq)
    np.save(os.path.join(d, "decode_pos.npy"), pos)
    post = baselines.rope(dq, np.arange(n, n + 3), theta, style)
    g = hq // h_
    for order in ("first", "zeroth"):
        ad = os.path.join(d, f"attend_{order}")
        run([kvc, "attend", "--keys", os.path.join(od, "keys.npy"), "--values", os.path.join(od, "values.npy"),
             "--indices", os.path.join(od, "indices.npy"), "--moments", od, "--queries",
             os.path.join(d, "decode.npy"), "--positions", os.path.join(d, "decode_pos.npy"), "--param",
             f"order={order}", "--out-dir", ad] + rope)
        got = [np.load(os.path.join(ad, f)) for f in ("plain_out.npy", "plain_lse.npy", "out.npy", "lse.npy")]
        for b in range(b_):
            for qh in range(hq):
                kh = qh // g
                c = counts[b, kh]
                mom = (int(mfiles[0][b, kh]),) + tuple(m[b, kh].astype(np.float64) for m in mfiles[1:])
                for i in range(3):
                    ref = corrected_attention(post[b, qh, i], kk[b, kh, :c], vv[b, kh, :c], idx[b, kh, :c],
                                              pos[b, i], mom, order)
                    for j, (x, r) in enumerate(zip((got[0][b, qh, i], got[1][b, qh, i], got[2][b, qh, i],
                                                    got[3][b, qh, i]), ref)):
                        err = np.abs(x - r).max() / max(1.0, np.abs(r).max())
                        if not err <= 1e-4:
                            sys.exit(f"FAILED: moment_kv {label} attend order={order} query ({b},{qh},{i}): output "
                                     f"{j} differs from the spec's formula by {err} (relative)")
        # The correction actually moved the output (something was evicted).
        if order == "first" and np.any(mfiles[0] > 0) and np.allclose(got[0], got[2]):
            sys.exit(f"FAILED: moment_kv {label}: the corrected output equals the plain one")
        checked += 1
    return checked


def check_moment_kv(kvc, vectors, work):
    """MomentKV's CLI: synthetic GQA cases (float32, and 16-bit storage) and, with the vectors, every window case."""
    rng = np.random.default_rng(2606)
    checked = 0
    cases = [
        ("gqa_f32", (1, 2, 4, 48, 8, 8), 12, "neox", 20, {"n_recent": 6}),
        ("mha_dv_rounds1", (2, 2, 2, 40, 8, 6), 8, "interleaved", 14,
         {"n_recent": 4, "prefill_rounds": 1, "n_sink": 2}),
        ("greedy_fp16", (1, 1, 2, 30, 4, 4), 6, "neox", 10,
         {"n_recent": 3, "prefill_rounds": 20, "storage": "fp16", "kernel_size": 1}),
    ]
    for label, (b, h, hq, n, dk, dv), w, style, budget, extra in cases:
        keys = rng.standard_normal((b, h, n, dk)).astype(np.float32)
        values = rng.standard_normal((b, h, n, dv)).astype(np.float32)
        queries = rng.standard_normal((b, hq, w, dk)).astype(np.float32)
        checked += check_moment_case(kvc, work, label, keys, values, queries, w, 10000.0, style, budget, extra)
    manifest = os.path.join(vectors, "window_manifest.txt")
    if os.path.exists(manifest):
        for case in open(manifest).read().split():
            d = os.path.join(vectors, case)
            w, theta, style = read_meta(d)
            keys = np.load(os.path.join(d, "keys.npy")).astype(np.float32)
            values = np.load(os.path.join(d, "values.npy")).astype(np.float32)
            queries = np.load(os.path.join(d, "queries.npy")).astype(np.float32)
            n = keys.shape[2]
            budget = max(2 + min(w, 8), n // 3)
            checked += check_moment_case(kvc, work, case, keys, values, queries, w, theta, style, budget,
                                         {"n_recent": min(w, 8), "prefill_rounds": 4})
    return checked


def main():
    kvc, vectors, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    moment_checked = check_moment_kv(kvc, vectors, work)  # its synthetic cases need no vectors
    if not os.path.exists(os.path.join(vectors, "manifest.txt")):
        print(f"{moment_checked} MomentKV CLI checks passed; SKIPPED: no reference vectors")
        sys.exit(77)
    checked = moment_checked + check_key_policies(kvc, vectors, work)
    if os.path.exists(os.path.join(vectors, "window_manifest.txt")):
        checked += check_window_policies(kvc, vectors, work)
    else:
        print("note: no window_manifest.txt: SnapKV/TOVA CLI checks skipped")
    if os.path.exists(os.path.join(vectors, "stateful_manifest.txt")):
        checked += check_stateful_policies(kvc, vectors, work)
    else:
        print("note: no stateful_manifest.txt: Expected Attention/H2O CLI checks skipped")
    checked += check_allocators(kvc, vectors, work)
    checked += check_dump(kvc, vectors, work)
    print(f"{checked} CLI checks against the NumPy oracle passed")


if __name__ == "__main__":
    main()
