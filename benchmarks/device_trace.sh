#!/usr/bin/env bash
# A short lease for where a step's device time goes: llama3.2-3b at 8K tokens without
# checkpointing, hexiseq and the transformers reference, the last step of each as a Chrome
# trace, then benchmarks/step_trace.py's tables of both. Output under $OUT: trace.log,
# trace_rows.json, hexiseq-*.json.gz, reference-*.json.gz. The call, from the repo root
# (wheels as for device_session.sh):
#
#   run(command="bash benchmarks/device_trace.sh", carry=[".whl"], timeout_s=300)
set -u
REPO=$(pwd)
source "$REPO/benchmarks/_device_stages.sh"
begin trace.log ${DEADLINE_S:-270}
install_wheels || exit 1
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm --format=csv
cd /tmp || exit 1  # -m modules: the repo's hexiseq/ folder would shadow the installed package
stage trace 220 python3 "$REPO/benchmarks/runtime_gpu.py" --lengths ${LENGTHS:-8192} \
    --checkpointing ${CKPT:-off} --warmup 1 --steps 3 --planned-only --no-write \
    --save-json "$OUT/trace_rows.json" --trace-dir "$OUT" --timeout 100
python3 "$REPO/benchmarks/step_trace.py" "$OUT"/*.json.gz
echo "== done at $(($(date +%s) - START_S)) s"
