#!/usr/bin/env bash
# A lease after a runtime change (benchmarks/device_session.sh is the full one, with the compute
# sweep): the GPU tests (attention kernels, fused RMSNorm), llama3.2-3b at 8K and 16K tokens
# with and without checkpointing against the transformers reference, one 8K step of hexiseq as
# a Chrome trace (read with benchmarks/step_trace.py), then hexiseq alone at the longest plan
# the planner passes (--near-cap) and at 32K with checkpointing. Output under $OUT:
# recheck.log, rows.json, rows_more.json, trace-8k.json.gz; with COMPILE=1 first, an 8K row
# with --compile (compiled.json; compiling took over 52 s on an H200) in place of the trace and
# the longer rows. The call, from the repo root (wheels as for device_session.sh):
#
#   run(command="bash benchmarks/device_recheck.sh", carry=[".whl"], timeout_s=520)
set -u
REPO=$(pwd)
source "$REPO/benchmarks/_device_stages.sh"
begin recheck.log 470
install_wheels || exit 1
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm --format=csv
cd /tmp || exit 1  # -m modules: the repo's hexiseq/ folder would shadow the installed package
ROWS=(python3 "$REPO/benchmarks/runtime_gpu.py" --planned-only --warmup 1 --steps 3 --no-write)
[[ ${SKIP_TESTS:-} ]] || stage gpu-tests 45 python3 -m pytest -q -p no:cacheprovider -m gpu \
    --rootdir "$REPO" -c "$REPO/pyproject.toml" "$REPO/tests/runtime/test_kernels.py" \
    "$REPO/tests/runtime/test_elementwise.py"
stage rows 270 "${ROWS[@]}" --lengths 8192 16384 --checkpointing both --timeout 100 \
    --save-json "$OUT/rows.json"
python3 - "$REPO/benchmarks" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import torch
import runtime_gpu
from hexiseq import ModelSpec
gpu = runtime_gpu.catalog_gpu(torch.cuda.get_device_name(0)) or "H100-SXM"
plan, _ = runtime_gpu.one_device_plan(gpu, ModelSpec.preset("llama3.2-3b"), 8192, False, True)
plan.to_json("/tmp/plan-8k.json")
PY
if [[ ${COMPILE:-} ]]; then
    stage compiled 330 "${ROWS[@]}" --hexiseq-only --lengths 8192 16384 --checkpointing off \
        --compile --timeout 160 --save-json "$OUT/compiled.json"
    echo "== done at $(($(date +%s) - START_S)) s"
    exit 0
fi
stage trace 40 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m hexiseq.runtime.train --plan /tmp/plan-8k.json --steps 2 --no-store --device cuda \
    --torch-profile "$OUT/trace-8k.json.gz"
[[ -f $OUT/trace-8k.json.gz ]] && python3 "$REPO/benchmarks/step_trace.py" "$OUT/trace-8k.json.gz"
stage more 150 "${ROWS[@]}" --hexiseq-only --lengths 32768 --checkpointing on --near-cap \
    --timeout 100 --save-json "$OUT/rows_more.json"
echo "== done at $(($(date +%s) - START_S)) s"
