#!/usr/bin/env bash
# The bf16 CUTLASS expert stage under each (gate_up, down) GroupedGemmConfig pair forced by FULCRUM_BF16_GEMM_CONFIGS
# (moe_layer.cpp), side by side in one GPU call: bench moe at 4096 and 16384 tokens, both model shapes, no torch
# peer; a JSON per pair in $OUT, then the uniform-routing expert-stage medians at both sizes as a table and the pair
# with the lowest mean time relative to the first pair on the last line. After scripts/gpu_machine_run.sh built build-cuda/.
# Usage: bench/moe_config_sweep.sh GIT_COMMIT PAIR... ("default" leaves the variable unset; a pair is "U,D").
set -uo pipefail
commit=$1
shift
out=${OUT:-/tmp/out}
loads=../shared/data/loads/qwen3-30b-a3b_prefill_gsm8k_en.csv
for pair in "$@"; do
  if [ "$pair" = default ]; then unset FULCRUM_BF16_GEMM_CONFIGS; else export FULCRUM_BF16_GEMM_CONFIGS=$pair; fi
  build-cuda/bin/fulcrum bench moe --loads "$loads" --tokens 4096 16384 --torch-peer off \
    --json "$out/moe_bf16_configs_${pair/,/_}.json" --git-commit "$commit" > /dev/null 2>&1 || echo "pair $pair: bench failed"
done
unset FULCRUM_BF16_GEMM_CONFIGS
python3 - "$out" "$@" <<'PY'
import json, sys
out, pairs = sys.argv[1], sys.argv[2:]
rows = {}
print("pair     " + "  ".join(f"{m} T={t} ms" for m in ("30B", "235B") for t in (4096, 16384)))
for pair in pairs:
    try:
        d = json.load(open(f"{out}/moe_bf16_configs_{pair.replace(',', '_')}.json"))
    except OSError:
        continue
    ms = {(r["model"], r["tokens"]): r["expert_gemm"]["cutlass"]["ms"] for r in d["results"] if r["scenario"] == "uniform"}
    row = [ms.get((m, t)) for m in ("qwen3-30b-a3b", "qwen3-235b-a22b") for t in (4096, 16384)]
    print(f"{pair:8s} " + "  ".join(f"{v:.3f}" if v else "-" for v in row))
    if all(row):
        rows[pair] = row
if rows:
    ref = rows.get(pairs[0]) or next(iter(rows.values()))
    score = {p: sum(v / r for v, r in zip(row, ref)) / len(ref) for p, row in rows.items()}  # mean time vs the first
    best = min(score, key=score.get)
    print(f"best {best} (mean time {score[best]:.3f} of {pairs[0]})")
PY
