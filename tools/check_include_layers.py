#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""tools/check_include_layers.py: kvc's headers include one way, down the layers of docs/design.md.

A header may include its own layer and the layers below it, never one above:

    core      config.hpp, version.hpp, core/          the views, plans, status, workspaces: no policy
    math      quant/, rate_distortion/                quantisation and bit-allocation solvers over core types
    policies  scorers/, selectors/                    each policy's parameters and host-side decisions
    store     store/                                  ragged, paged and packed stores
    pipeline  pipeline/                               the drivers (compress, blockwise, decode, packing)
    attention attention/                              attention front ends
    engine    engine/                                 the per-layer compressor: every policy behind one path
    backends  backend/cpu/, backend/cuda/             the kernels
    entry     calibration/, kvc.hpp, cuda.cuh         host-side tools over a backend, umbrella headers

Inside a backend, a kernel header (scorers/, selectors/, pipeline/, attention/, store/) includes its backend's
detail/ helpers and config, not another kernel header: what two kernels share lives in detail/. The two backends do
not include each other.

    python3 tools/check_include_layers.py [include/kvc]   # exit 1 with one line per violation
    python3 tools/check_include_layers.py --self-test     # the check catches each kind of violation
"""
import pathlib
import re
import sys
import tempfile

LAYERS = [
    ("core", ["config.hpp", "version.hpp", "core/"]),
    ("math", ["quant/", "rate_distortion/"]),
    ("policies", ["scorers/", "selectors/"]),
    ("store", ["store/"]),
    ("pipeline", ["pipeline/"]),
    ("attention", ["attention/"]),
    ("engine", ["engine/"]),
    ("backends", ["backend/cpu/", "backend/cuda/"]),
    ("entry", ["calibration/", "kvc.hpp", "cuda.cuh"]),
]
KERNEL_DIRS = ("scorers", "selectors", "pipeline", "attention", "store")
# Kernel headers that still include a sibling (until the window scorers become one kernel family, issue 24 section 2).
# The list may only shrink: an entry that no longer applies is an error too.
KNOWN_SIBLING_INCLUDES = {
    # MomentKV's MI score is built on SnapKV's (its chunk-mean base): a composition of two policies' kernels.
    ("backend/cpu/scorers/moment_kv.hpp", "backend/cpu/scorers/snap_kv.hpp"),
    ("backend/cuda/scorers/moment_kv.cuh", "backend/cuda/scorers/snap_kv.cuh"),
}
INCLUDE = re.compile(r'^\s*#\s*include\s*<kvc/([^>]+)>', re.M)


def layer(path: str):
    """The index of the layer a header (relative to include/kvc) belongs to, or None when none names it."""
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(path == p or (p.endswith("/") and path.startswith(p)) for p in prefixes):
            return i
    return None


def violations(root: pathlib.Path, known=frozenset()):
    out, seen = [], set()
    files = sorted(p for p in root.rglob("*") if p.suffix in (".hpp", ".cuh", ".h"))
    for f in files:
        src = f.relative_to(root).as_posix()
        lsrc = layer(src)
        if lsrc is None:
            out.append(f"{src}: not in any layer of tools/check_include_layers.py (add its folder to a layer)")
            continue
        for line, dst in ((f.read_text()[:m.start()].count("\n") + 1, m.group(1))
                          for m in INCLUDE.finditer(f.read_text())):
            where = f"include/kvc/{src}:{line}: includes <kvc/{dst}>"
            ldst = layer(dst)
            if ldst is None:
                out.append(f"{where}, which is in no layer")
            elif ldst > lsrc:
                out.append(f"{where}: up from layer '{LAYERS[lsrc][0]}' to '{LAYERS[ldst][0]}'")
            s, d = src.split("/"), dst.split("/")
            if s[0] == "backend" and d[0] == "backend" and len(s) > 2 and len(d) > 2:
                if s[1] != d[1]:
                    out.append(f"{where}: one backend includes the other")
                elif s[2] in KERNEL_DIRS and d[2] in KERNEL_DIRS:
                    if (src, dst) in known:
                        seen.add((src, dst))
                    else:
                        out.append(f"{where}: a kernel header includes another (move what they share to detail/)")
    for src, dst in sorted(known - seen):
        out.append(f"include/kvc/{src}: no longer includes <kvc/{dst}>: remove the pair from KNOWN_SIBLING_INCLUDES")
    return out


def self_test() -> int:
    cases = {
        "core/a.hpp": ("#include <kvc/selectors/top_k.hpp>\n", "up from layer 'core' to 'policies'"),
        "store/a.hpp": ("#include <kvc/pipeline/compact.hpp>\n", "up from layer 'store' to 'pipeline'"),
        "backend/cuda/scorers/a.cuh": ("#include <kvc/backend/cuda/scorers/b.cuh>\n", "a kernel header includes"),
        "backend/cpu/attention/a.hpp": ("#include <kvc/backend/cuda/detail/b.cuh>\n", "one backend includes"),
        "widgets/a.hpp": ("\n", "not in any layer"),
        "backend/cuda/scorers/e.cuh": ("\n", "no longer includes <kvc/backend/cuda/scorers/c.cuh>"),
    }
    ok = {
        "pipeline/a.hpp": "#include <kvc/store/ragged.hpp>\n#include <kvc/core/status.hpp>\n",
        "backend/cuda/scorers/c.cuh": "#  include <kvc/backend/cuda/detail/logits.cuh>\n#include <kvc/scorers/tova.hpp>\n",
        "backend/cuda/scorers/e.cuh": "#include <kvc/backend/cuda/scorers/c.cuh>\n",  # the listed exception
    }
    failed = 0
    for name, (text, want) in cases.items():
        with tempfile.TemporaryDirectory() as d:
            root = pathlib.Path(d)
            for n, t in list(ok.items()) + [(name, text)]:
                (root / n).parent.mkdir(parents=True, exist_ok=True)
                (root / n).write_text(t)
            found = violations(root, frozenset({("backend/cuda/scorers/e.cuh", "backend/cuda/scorers/c.cuh")}))
            if len(found) != 1 or want not in found[0]:
                print(f"self-test: {name}: expected one violation with '{want}', got {found}")
                failed += 1
    print(f"self-test: {len(cases) - failed} of {len(cases)} planted violations caught, nothing else reported")
    return 1 if failed else 0


def main() -> int:
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent / "include/kvc")
    found = violations(root, frozenset(KNOWN_SIBLING_INCLUDES))
    for v in found:
        print(v)
    print(f"include layers: {len(found)} violation(s) in {root}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
