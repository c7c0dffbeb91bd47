#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""tools/check_launch_bounds.py: every kvc kernel launched with more than 256 threads per block declares
__launch_bounds__ at least that large.

Without it nvcc may give such a kernel more registers per thread than a block of that size can have (a -G debug
build easily does), and the launch fails with "too many resources requested". The CUDA emulator cannot see register
limits (__launch_bounds__ is empty there), so this reads the sources: each launch site
`launch(KVC_CUDA_KERNEL("...", kernel), grid, block, ...)` whose block is a constant expression of the
`inline constexpr int NAME = ...;` constants, against the kernel's own `__launch_bounds__(...)`.

    python3 tools/check_launch_bounds.py [include/kvc/backend/cuda]     # exit 1 and a list when one is missing
"""
import pathlib
import re
import sys


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent /
                        "include/kvc/backend/cuda")
    text = "\n".join(p.read_text() for p in sorted(root.rglob("*.cuh")))
    consts = {"warp_size": 32}
    for name, expr in re.findall(r"inline constexpr int (\w+) = ([^;]+);", text):
        try:
            consts[name] = int(eval(expr, {}, dict(consts)))  # noqa: S307 (kvc's own constants, e.g. a * warp_size)
        except Exception:
            pass

    def value(expr):
        expr = re.sub(r"\b(bc|backend::cuda)::", "", expr).replace("static_cast<unsigned>", "")
        try:
            return int(eval(expr, {}, dict(consts)))  # noqa: S307
        except Exception:
            return None  # a run-time block size: not checked

    bounds = {}
    for expr, name in re.findall(r"__launch_bounds__\(([^)]*)\)\s*(\w+)\s*\(", text):
        bounds[name] = value(expr)
    problems, checked = [], 0
    for kernel, rest in re.findall(r'KVC_CUDA_KERNEL\("[^"]*",\s*\(?\s*(?:bc::|backend::cuda::)?(\w+)[^)]*\)\)?,(.*?);',
                                   text, flags=re.S):
        args, depth, cur = [], 0, ""
        for ch in rest:  # the launch's arguments: grid, block, ...
            if ch in "([{<" and not (ch == "<" and cur.rstrip().endswith(" ")):
                depth += ch in "([{"
            if ch in ")]}":
                depth -= 1
            if ch == "," and depth == 0:
                args.append(cur.strip())
                cur = ""
                if len(args) == 2:
                    break
            else:
                cur += ch
        if len(args) < 2:
            continue
        block = value(args[1])
        if block is None or block <= 256:
            continue
        checked += 1
        bound = bounds.get(kernel)
        if bound is None or bound < block:
            problems.append(f"{kernel}: launched with {block} threads, __launch_bounds__ "
                            f"{'missing' if bound is None else bound}")
    for p in problems:
        print(f"check_launch_bounds: {p}")
    print(f"check_launch_bounds: {checked} launch sites above 256 threads, {len(problems)} without enough bounds")
    return 1 if problems or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
