#!/usr/bin/env bash
# Runs that calibrate the memory model on this machine (benchmarks/costmodel_accuracy.py
# --runs-store): for each (ranks, model, tokens), `hexiseq plan` on a CPU cluster of that many
# ranks (datasheet model, not saved) and `hexiseq run --steps 2` of the plan, whose measured
# peak memory per rank goes to the store. Usage: bash benchmarks/memory_runs.sh STORE_URL
# (about 10 minutes on 2 cores). Then: hexiseq fit --store STORE_URL.
set -euo pipefail
store=${1:?usage: bash benchmarks/memory_runs.sh STORE_URL}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for ranks in 2 4; do
  printf 'name: cpu%s\nnodes:\n  - {name: a, gpu: cpu, count: %s}\n' "$ranks" "$ranks" \
    > "$scratch/cpu$ranks.yaml"
done
for spec in "2 small 2048" "2 small 4096" "2 small 8192" "2 small 16384" "2 small 32768" \
            "4 small 4096" "4 small 16384" "4 small 32768" \
            "2 tiny 8192" "2 tiny 32768" "4 tiny 65536"; do
  read -r ranks model tokens <<< "$spec"
  plan="$scratch/plan-$ranks-$model-$tokens.json"
  .venv/bin/hexiseq plan --cluster "$scratch/cpu$ranks.yaml" --model "$model" \
    --seq-len "$tokens" --out "$plan" --no-store > /dev/null
  .venv/bin/hexiseq run --plan "$plan" --steps 2 --store "$store" > /dev/null
  echo "ran $spec"
done
