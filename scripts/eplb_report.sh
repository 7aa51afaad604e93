#!/usr/bin/env bash
# Balancedness of `deepseek` and `fulcrum` beside the lower bound on the 12 real Qwen3-30B-A3B loads
# (../shared/data/loads) at the golden configurations, with plan times; then migration-aware replanning
# from each workload's fulcrum plan to the next workload. Prints markdown tables (figures measured here).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=build/bin/fulcrum
loads_dir=${1:-../shared/data/loads}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
field() { python3 -c "import json,sys; d=json.load(sys.stdin); print(d['$1'])"; }

echo "| GPUs | slots | deepseek mean (min..max over loads) | fulcrum mean (min..max) | lower bound mean | deepseek ms | fulcrum ms |"
echo "|---|---|---|---|---|---|---|"
for cfg in "8 128" "8 160" "16 160" "32 160" "32 192"; do
  set -- $cfg
  for alg in deepseek fulcrum; do : >"$tmp/$alg"; done
  : >"$tmp/lb"
  for f in "$loads_dir"/*.csv; do
    for alg in deepseek fulcrum; do
      $bin plan --loads "$f" --gpus "$1" --physical-experts "$2" --algorithm $alg --json >"$tmp/out.json"
      echo "$(field balancedness_mean <"$tmp/out.json") $(field plan_seconds <"$tmp/out.json")" >>"$tmp/$alg"
    done
    field lower_bound_balancedness_mean <"$tmp/out.json" >>"$tmp/lb"
  done
  python3 - "$1" "$2" "$tmp" <<'PY'
import sys, statistics as st
g, p, tmp = sys.argv[1], sys.argv[2], sys.argv[3]
def rows(name): return [tuple(map(float, l.split())) for l in open(f"{tmp}/{name}")]
ds, fu = rows("deepseek"), rows("fulcrum")
lb = [float(l) for l in open(f"{tmp}/lb")]
fmt = lambda r: f"{st.mean(x[0] for x in r):.4f} ({min(x[0] for x in r):.4f}..{max(x[0] for x in r):.4f})"
print(f"| {g} | {p} | {fmt(ds)} | {fmt(fu)} | {st.mean(lb):.4f} | {st.median(x[1] for x in ds)*1e3:.2f} | {st.median(x[1] for x in fu)*1e3:.2f} |")
PY
done

echo
echo "Replanning from workload i's fulcrum placement to workload i+1 (cyclic), summed over the 12 pairs:"
echo "| GPUs | slots | deepseek moved | deepseek bal | fulcrum --current moved | fulcrum bal | ratio |"
echo "|---|---|---|---|---|---|---|"
files=("$loads_dir"/*.csv)
n=${#files[@]}
for cfg in "16 160" "32 160" "32 192"; do
  set -- $cfg
  ds_moved=0; fu_moved=0; ds_bal=(); fu_bal=()
  for ((i = 0; i < n; i++)); do
    cur=${files[$i]}; next=${files[$(((i + 1) % n))]}
    $bin plan --loads "$cur" --gpus "$1" --physical-experts "$2" --output "$tmp/current.json" >/dev/null
    $bin plan --loads "$next" --gpus "$1" --physical-experts "$2" --algorithm deepseek --current "$tmp/current.json" --json >"$tmp/ds.json"
    $bin plan --loads "$next" --gpus "$1" --physical-experts "$2" --algorithm fulcrum --current "$tmp/current.json" --json >"$tmp/fu.json"
    ds_moved=$((ds_moved + $(field experts_moved <"$tmp/ds.json")))
    fu_moved=$((fu_moved + $(field experts_moved <"$tmp/fu.json")))
    ds_bal+=("$(field balancedness_mean <"$tmp/ds.json")")
    fu_bal+=("$(field balancedness_mean <"$tmp/fu.json")")
  done
  python3 -c "
import statistics as st
ds=[$(IFS=,; echo "${ds_bal[*]}")]; fu=[$(IFS=,; echo "${fu_bal[*]}")]
print(f'| $1 | $2 | $ds_moved | {st.mean(ds):.4f} | $fu_moved | {st.mean(fu):.4f} | {$fu_moved/$ds_moved:.3f} |')"
done
