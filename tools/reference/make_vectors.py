# SPDX-License-Identifier: Apache-2.0
"""Writes reference vectors for kvc's tests: inputs and the NumPy oracle's scores and kept sets.

Layout of --out:
  manifest.txt                 one case directory name per line
  <case>/keys.npy values.npy   inputs [B, Hkv, N, d] (float32 or float16)
  <case>/scores_<policy>.npy   oracle scores [B, Hkv, N], float64
  <case>/kept_<policy>_<r>.npy oracle kept indices [B, Hkv, k] (int64, ascending) at ratio r
Cases: random float32, random float16 (the oracle sees the rounded values), and, when the model folder exists,
real keys/values from every layer of tinystories-656k (a story generated greedily by tools/reference/model.py).
Exit code 77 (ctest's skip code) when NumPy is missing.
"""
import argparse
import os
import sys

try:
    import numpy as np
except ImportError:
    print("SKIPPED: NumPy is not installed (apt-get install python3-numpy)")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402

RATIOS = (0.25, 0.5, 0.75)


def write_case(out, name, keys, values):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    np.save(os.path.join(d, "keys.npy"), keys)
    np.save(os.path.join(d, "values.npy"), values)
    k64 = keys.astype(np.float64)
    B, H, N, _ = keys.shape
    scores = {"key_diff": oracle.key_diff_scores(k64), "knorm": oracle.knorm_scores(k64)}
    for policy, s in scores.items():
        np.save(os.path.join(d, f"scores_{policy}.npy"), s)
        for r in RATIOS:
            keep = oracle.ratio_keep(N, r)
            kept = np.stack([np.stack([oracle.top_k(s[b, h], keep) for h in range(H)]) for b in range(B)])
            np.save(os.path.join(d, f"kept_{policy}_{r}.npy"), kept.astype(np.int64))
    for r in RATIOS:
        kept = oracle.streaming_llm_keep(N, oracle.ratio_keep(N, r), 4)
        np.save(os.path.join(d, f"kept_streaming_llm_{r}.npy"), np.broadcast_to(kept, (B, H, len(kept))).copy())
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


if __name__ == "__main__":
    main()
