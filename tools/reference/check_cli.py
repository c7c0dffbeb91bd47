# SPDX-License-Identifier: Apache-2.0
"""End-to-end check of the `kvc` CLI against the NumPy oracle on the reference vectors.

For every case in the manifest and every policy: `kvc score` must match the oracle's scores (float32 within
1e-5, float16 within 2e-3), and `kvc compress --ratio 0.5` must write the oracle's kept set (tokens whose oracle
scores lie within 1e-5 of the selection boundary may swap), plus keys/values equal to the gathered inputs.
Usage: check_cli.py KVC_BINARY VECTORS_DIR WORK_DIR
"""
import os
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("SKIPPED: NumPy is not installed")
    sys.exit(77)


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {r.returncode}: {r.stderr}")


def main():
    kvc, vectors, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    if not os.path.exists(os.path.join(vectors, "manifest.txt")):
        print("SKIPPED: no reference vectors")
        sys.exit(77)
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
            idx = np.load(os.path.join(od, "indices.npy"))
            ref = np.load(os.path.join(d, f"kept_{policy}_0.5.npy"))
            if idx.shape != ref.shape:
                sys.exit(f"FAILED: {case} {policy} kept shape {idx.shape}, oracle {ref.shape}")
            for b in range(idx.shape[0]):
                for h in range(idx.shape[1]):
                    diff = set(idx[b, h]) ^ set(ref[b, h])
                    if diff and policy != "streaming_llm":
                        s = np.load(os.path.join(d, f"scores_{policy}.npy"))[b, h]
                        boundary = np.sort(s)[::-1][len(ref[b, h]) - 1]
                        if max(abs(s[list(diff)] - boundary)) > 1e-5:
                            sys.exit(f"FAILED: {case} {policy} head ({b},{h}) kept set differs: {sorted(diff)}")
                    elif diff:
                        sys.exit(f"FAILED: {case} {policy} head ({b},{h}) kept set differs: {sorted(diff)}")
                    kk = np.load(os.path.join(od, "keys.npy"))[b, h]
                    if not np.array_equal(kk, keys[b, h, idx[b, h]]):
                        sys.exit(f"FAILED: {case} {policy} compressed keys are not the kept input rows")
                    vv = np.load(os.path.join(od, "values.npy"))[b, h]
                    if not np.array_equal(vv, values[b, h, idx[b, h]]):
                        sys.exit(f"FAILED: {case} {policy} compressed values are not the kept input rows")
            checked += 1
    print(f"{checked} CLI checks against the NumPy oracle passed")


if __name__ == "__main__":
    main()
