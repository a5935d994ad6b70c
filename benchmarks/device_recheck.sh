#!/usr/bin/env bash
# A short lease after a runtime change (benchmarks/device_session.sh is the full one): the GPU
# kernel tests, then hexiseq's side alone (the transformers reference's figures of the full
# session stand) at 8K and 16K tokens without checkpointing, eager; the longest plan the
# planner passes on the card (--near-cap); 8K with --compile; one 8K step under torch.profiler.
# Output under $OUT: recheck.log, eager.json (with the near-cap row), compiled.json,
# torch-profile-8k.txt. The call, from the repo root (wheels as for device_session.sh):
#
#   run(command="bash benchmarks/device_recheck.sh", carry=[".whl"], timeout_s=360)
#
# The compiled row has 150 s: on the H200 compiling the block took longer than 52 s, which the
# 60 s stage of the first recheck did not leave.
set -u
REPO=$(pwd)
source "$REPO/benchmarks/_device_stages.sh"
begin recheck.log 330
install_wheels || exit 1
cd /tmp || exit 1  # -m modules: the repo's hexiseq/ folder would shadow the installed package
ROWS=(python3 "$REPO/benchmarks/runtime_gpu.py" --hexiseq-only --planned-only --warmup 1
    --steps 3 --no-write --timeout 100)  # `timeout` runs programs, not shell functions
[[ ${SKIP_TESTS:-} ]] || stage gpu-tests 30 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$REPO" \
    -c "$REPO/pyproject.toml" "$REPO/tests/runtime/test_kernels.py"
stage eager 110 "${ROWS[@]}" --lengths 8192 16384 --checkpointing off --near-cap \
    --save-json "$OUT/eager.json"
stage compiled 150 "${ROWS[@]}" --lengths 8192 --checkpointing off --compile \
    --timeout 140 --save-json "$OUT/compiled.json"  # the later --timeout wins
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
stage torch-profile 30 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m hexiseq.runtime.train --plan /tmp/plan-8k.json --steps 3 --no-store --device cuda \
    --torch-profile "$OUT/torch-profile-8k.txt"
echo "== done at $(($(date +%s) - START_S)) s"
