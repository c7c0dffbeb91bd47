# SPDX-License-Identifier: Apache-2.0
"""What the oracles' self-tests (test_*.py) share: the NumPy guard (exit 77, which ctest reports as skipped), the
list of failures, check(), and the verdict (exit 1 listing every failure, or the summary line)."""
import sys

failures = []


def require_numpy():
    try:
        import numpy
    except ImportError:
        print("SKIPPED: NumPy is not installed (apt-get install python3-numpy)")
        sys.exit(77)
    return numpy


def check(name, ok, detail=""):
    if not ok:
        failures.append(f"{name}: {detail}")


def finish(summary):
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print(summary)
