set -u
C=3edb978
for s in 32 0 16 8 32; do
  echo "## skinny-max-entries $s"
  build-cuda/bin/fulcrum bench generate --batch 1 2 3 4 --context 512 2048 --prefill none --steps 20 --warmup 5 --skinny-max-entries $s \
    --json $OUT/skinny_$s.json --git-commit $C 2>&1 | grep -E "decode|error"
done
