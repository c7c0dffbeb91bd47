#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The MomentKV ablation of docs/eval.md (the paper's Table 3 on a shared model): Ada-KV's budgets with SnapKV's base
# score, then MomentKV's MI and NC switched on one at a time, both, and the zeroth-order correction. Every
# moment_kv row runs the baseline's pooling (max over 7) and the baseline protects the sink, so that
# moment_kv(mi=false,correction=false)+ada_kv selects exactly what snap_kv+ada_kv selects.
#   tools/eval/moment_kv_ablation.sh KVC_EVAL MODEL_DIR OUT_DIR [extra kvc-eval run options...]
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 KVC_EVAL MODEL_DIR OUT_DIR [kvc-eval run options...]" >&2
  exit 2
fi
eval_bin=$1 model=$2 out=$3
shift 3
moment_rows=('moment_kv(mi=false,correction=false)+ada_kv' 'moment_kv(mi=true,correction=false)+ada_kv'
  'moment_kv(mi=false,correction=true)+ada_kv' 'moment_kv(mi=true,correction=true)+ada_kv'
  'moment_kv(order=zeroth)+ada_kv')
rows='snap_kv+ada_kv'
params=(--param 'snap_kv+ada_kv.n_sink=1')
for r in "${moment_rows[@]}"; do
  rows+=",$r"
  params+=(--param "$r.pooling=max" --param "$r.kernel_size=7")
done
exec "$eval_bin" run --model "$model" --out-dir "$out" --policies "$rows" "${params[@]}" \
  --ratios 0.25,0.5,0.75,0.9 --samples 8 --generate 0 "$@"
