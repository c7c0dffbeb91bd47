# SPDX-License-Identifier: Apache-2.0
"""Writes the reference logits kvc-eval's C++ runner is checked against (tests/reference/eval_oracle_test.cpp).

For each model of shared/models that exists, --out/eval/<model>/ gets
  tokens.npy   int64 [N]: BOS (1) then N - 1 ids drawn with numpy's default_rng(2026) from [3, vocab)
  logits.npy   float32 [N, vocab]: the independent NumPy runner's full-cache logits (tools/reference/model.py logits,
               float64 arithmetic)
Models absent: nothing is written for them (the C++ test skips with a message). Exit code 77 without NumPy.
"""
import argparse
import os
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("SKIPPED: NumPy is not installed (apt-get install python3-numpy)")
    sys.exit(77)

MODELS = {"tinystories-656k": ("tinystories-656k", 2048), "stories260k": ("stories260k", 512)}
TOKENS = 96


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shared", required=True, help="the shared/ folder (its models/ subfolder is read)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model.py")
    for name, (folder, vocab) in MODELS.items():
        model = os.path.join(a.shared, "models", folder)
        if not os.path.isdir(model):
            print(f"note: {model} absent: no reference logits for {name}")
            continue
        out = os.path.join(a.out, "eval", name)
        os.makedirs(out, exist_ok=True)
        rng = np.random.default_rng(2026)
        tokens = np.concatenate([[1], rng.integers(3, vocab, TOKENS - 1)]).astype(np.int64)
        np.save(os.path.join(out, "tokens.npy"), tokens)
        subprocess.run([sys.executable, runner, "logits", "--model", model, "--tokens",
                        os.path.join(out, "tokens.npy"), "--out", os.path.join(out, "logits.npy")], check=True)
        print(f"{name}: {TOKENS} tokens, logits written to {out}")


if __name__ == "__main__":
    main()
