#!/usr/bin/env bash
# One lease of a lent GPU machine (an H100 or H200), every measurement in one call:
#
#   1. smoke: the `small` model, 4K tokens, hexiseq and the transformers reference (stops here
#      if hexiseq's side fails, so the lease is not spent on runs that would fail the same way);
#   2. the GPU tests (`pytest -m gpu`: every attention kernel against plain attention);
#   3. benchmarks/runtime_gpu.py: llama3.2-3b at 8K, 16K and 32K tokens, checkpointing off and
#      on, hexiseq against transformers, each row with the plan's predicted step time, peak and
#      memory terms; plus one hexiseq row at the longest length the planner passes (--near-cap);
#   4. one 8K step of hexiseq under torch.profiler (`--torch-profile`);
#   5. a compute sweep (`hexiseq profile --grid benchmarks/grids/gpu_session.yaml`) into a
#      fresh store, for `hexiseq fit`.
#
# Each stage gets what is left of DEADLINE_S (default 450 s); output goes to $OUT (session.log,
# smoke.json, runtime_gpu.json, torch-profile-8k.txt, profile.db). Needs the wheels of
# benchmarks/runtime_gpu.py's docstring (plus highspy) in .whl. The call, from the repo root:
#
#   run(command="bash benchmarks/device_session.sh", carry=[".whl"], timeout_s=520)
#
# Then, here: benchmarks/runtime_gpu.py --from-json <files_at>/runtime_gpu.json, and
# `hexiseq fit --store sqlite:///<copy of profile.db>`; commit the files under profiles/.
set -u
REPO=$(pwd)
source "$REPO/benchmarks/_device_stages.sh"
begin session.log 450

echo "== setup"
install_wheels || exit 1
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,power.limit,driver_version \
    --format=csv
python3 - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "device", torch.cuda.get_device_name(0),
      "memory GiB", round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2))
EOF

stage smoke 120 python3 benchmarks/runtime_gpu.py --model small --lengths 4096 \
    --checkpointing off --warmup 1 --steps 2 --no-write --save-json "$OUT/smoke.json" \
    --timeout 100
python3 - "$OUT/smoke.json" <<'EOF' || { echo "== smoke failed: stopping"; exit 1; }
import json, sys
row = json.load(open(sys.argv[1]))["rows"][0]
side = row.get("hexiseq") or {}
print("smoke hexiseq:", {k: side.get(k) for k in ("status", "step_times_s", "peaks")})
print(side.get("output_tail", ""))
sys.exit(0 if side.get("step_times_s") else 1)
EOF

# Modules run with -m from /tmp: the repo root's hexiseq/ folder would shadow the installed
# package (its subpackages live elsewhere in the tree: pyproject's package-dir).
cd /tmp || exit 1
stage gpu-tests 60 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$REPO" \
    -c "$REPO/pyproject.toml" "$REPO/tests/runtime/test_kernels.py"

stage runtime-gpu 270 python3 "$REPO/benchmarks/runtime_gpu.py" --lengths 8192 16384 32768 \
    --warmup 1 --steps 3 --planned-only --near-cap --no-write \
    --save-json "$OUT/runtime_gpu.json" --timeout 150

python3 - "$REPO/benchmarks" <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
import torch
import runtime_gpu
from hexiseq import ModelSpec
gpu = runtime_gpu.catalog_gpu(torch.cuda.get_device_name(0)) or "H100-SXM"
plan, note = runtime_gpu.one_device_plan(gpu, ModelSpec.preset("llama3.2-3b"), 8192, False, True)
plan.to_json("/tmp/plan-8k.json")
print("torch-profile plan:", gpu, note)
EOF
stage torch-profile 90 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m hexiseq.runtime.train --plan /tmp/plan-8k.json --steps 3 --no-store --device cuda \
    --torch-profile "$OUT/torch-profile-8k.txt"

stage sweep 240 python3 -m hexiseq.cli profile --device cuda \
    --grid "$REPO/benchmarks/grids/gpu_session.yaml" \
    --store "sqlite:///$OUT/profile.db"

echo "== done at $(($(date +%s) - START_S)) s"
