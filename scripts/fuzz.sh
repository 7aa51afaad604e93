#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/) in build-fuzz with clang, ASan and UBSan, and runs each for a bounded
# time from its committed seed corpus (fuzz/corpus/<name>); any crash, leak, UB, timeout or broken parser
# contract fails the script, leaving the input as build-fuzz/findings/<name>/crash-*.
#   FUZZ_SECONDS   seconds per harness (default 20)
#   FUZZ_TARGETS   harnesses to run, space-separated (default: all)
#   FUZZ_JOBS      harnesses run at once (default: the core count)
# Extra arguments go to every harness (e.g. -only_ascii=1). Installs Debian's clang and libFuzzer runtime when
# missing (scripts/install_deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-20}
targets=${FUZZ_TARGETS:-"http_request safetensors_header config loads placement tokenizer_encode tokenizer_json"}
jobs=${FUZZ_JOBS:-$(nproc)}

FULCRUM_EXTRA_PACKAGES="clang libclang-rt-dev" scripts/install_deps.sh
command -v clang++ >/dev/null || { echo "fuzz: error: clang++ not found (Debian: apt-get install clang libclang-rt-dev)" >&2; exit 1; }
if [ ! -f build-fuzz/CMakeCache.txt ]; then
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFULCRUM_BUILD_FUZZ=ON \
    -DFULCRUM_ENABLE_CUDA=OFF -DFULCRUM_BUILD_TESTS=OFF -DFULCRUM_BUILD_BENCH=OFF >/dev/null
fi
ninja -C build-fuzz fuzz

# Each harness grows its own corpus in build-fuzz/corpus/<name> (the committed seeds stay as they are).
run_one() {
  local name=$1 work=build-fuzz/corpus/$1 findings=build-fuzz/findings/$1
  mkdir -p "$work" "$findings"
  if build-fuzz/bin/fuzz_"$name" "$work" fuzz/corpus/"$name" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -max_len=65536 -print_final_stats=1 -artifact_prefix="$findings/" "${@:2}" >build-fuzz/findings/"$name".log 2>&1; then
    echo "fuzz: $name: ok ($(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' build-fuzz/findings/"$name".log |
      grep -o '[0-9]*$') runs in ${seconds}s)"
  else
    echo "fuzz: $name: FAILED; last lines of build-fuzz/findings/$name.log:"
    tail -n 30 build-fuzz/findings/"$name".log
    return 1
  fi
}

failed=0
pids=()
names=()
for name in $targets; do
  run_one "$name" "$@" &
  pids+=($!)
  names+=("$name")
  if [ ${#pids[@]} -ge "$jobs" ]; then
    wait "${pids[0]}" || failed=1
    pids=("${pids[@]:1}")
  fi
done
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
[ "$failed" -eq 0 ] || { echo "fuzz: a harness failed (inputs in build-fuzz/findings/)"; exit 1; }
echo "fuzz: all harnesses ran ${seconds}s without a finding"
