#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# tools/eval/compare_runs.sh OLD NEW OUT [MODELS_DIR]: runs two kvc-eval binaries over the same 8 configurations
# per shared model (every policy at 4 ratios; allocator rows; --decode for every policy; allocator decode rows with
# both re-layouts; the MomentKV ablation with --decode; UNComp's variants with and without --decode) and reports
# every results.csv cell that differs, except `seconds`. Exit 0 when nothing differs, 1 otherwise. Used to check
# that a refactoring of kvc-eval's engine leaves its numbers alone (docs/eval.md).
set -euo pipefail
if [[ $# -lt 3 ]]; then
  echo "usage: $0 OLD_KVC_EVAL NEW_KVC_EVAL OUT_DIR [MODELS_DIR]" >&2
  exit 2
fi
old=$1 new=$2 out=$3 models=${4:-../shared/models}

run_all() {  # BIN DIR
  local bin=$1 dir=$2 m
  for name in tinystories-656k stories260k; do
    m=$models/$name
    "$bin" run --model "$m" --out-dir "$dir/$name-pre" --samples 4 --generate 0 >/dev/null
    "$bin" run --model "$m" --out-dir "$dir/$name-alloc" --samples 4 --generate 0 \
      --policies 'snap_kv,snap_kv+ada_kv,snap_kv+pyramid_kv,expected_attention+ada_kv,key_diff+ada_kv,h2o+ada_kv,tova+pyramid_kv,random+ada_kv,moment_kv+ada_kv,knorm+ada_kv+pyramid_kv' \
      >/dev/null
    "$bin" run --model "$m" --out-dir "$dir/$name-dec" --samples 3 --generate 0 --prompt-tokens 64 \
      --continuation 256 --decode interval=32,target=96 >/dev/null
    for relayout in fill compress; do
      "$bin" run --model "$m" --out-dir "$dir/$name-adec-$relayout" --samples 3 --generate 0 --prompt-tokens 64 \
        --continuation 256 --decode "interval=32,target=96,relayout=$relayout" \
        --policies 'snap_kv+ada_kv,key_diff+ada_kv,expected_attention+ada_kv,snap_kv+pyramid_kv,random+ada_kv' \
        >/dev/null
    done
    "$bin" run --model "$m" --out-dir "$dir/$name-moment" --samples 3 --generate 0 \
      --policies 'moment_kv(mi=false,correction=false),moment_kv(correction=false),moment_kv(mi=false),moment_kv,moment_kv+ada_kv,moment_kv(decode_evict=false)' \
      --decode interval=32,target=96,buffer=32 >/dev/null
    "$bin" run --model "$m" --out-dir "$dir/$name-uncomp" --samples 3 --generate 0 \
      --policies 'uncomp,uncomp(gqa=expand),uncomp(rule=majority_vote),uncomp(groups=2),uncomp(stages=true)' >/dev/null
    "$bin" run --model "$m" --out-dir "$dir/$name-uncomp-dec" --samples 3 --generate 0 --prompt-tokens 64 \
      --continuation 256 --decode interval=32,target=48 --policies 'uncomp,uncomp(gqa=expand)' >/dev/null
  done
}

run_all "$old" "$out/old"
run_all "$new" "$out/new"
python3 - "$out/old" "$out/new" <<'PY'
import csv, os, sys
a, b = sys.argv[1], sys.argv[2]
bad = 0
for d in sorted(os.listdir(a)):
    fa, fb = os.path.join(a, d, 'results.csv'), os.path.join(b, d, 'results.csv')
    ra, rb = list(csv.DictReader(open(fa))), list(csv.DictReader(open(fb)))
    if len(ra) != len(rb):
        print(f'{d}: {len(ra)} rows against {len(rb)}'); bad += 1; continue
    for x, y in zip(ra, rb):
        diff = {k: (x[k], y.get(k)) for k in x if k != 'seconds' and x[k] != y.get(k)}
        if diff:
            bad += 1
            print(d, x['policy'], x['ratio'], diff)
print(f'{bad} rows differ')
sys.exit(1 if bad else 0)
PY
