import gzip
import json
import subprocess
import sys

from hexiseq import Cluster, ModelSpec
from hexiseq.search import plan_search


def _profiled_run(tmp_path, output):
    cluster = Cluster.from_dict(
        {"name": "one", "nodes": [{"name": "n0", "gpu": "cpu", "count": 1}]}
    )
    plan = plan_search(cluster, ModelSpec.preset("tiny"), 256, seed=0).best
    plan_path = tmp_path / "plan.json"
    plan.to_json(plan_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "1", "-m", "hexiseq.runtime.train", "--plan", str(plan_path)]
    command += ["--steps", "2", "--no-store", "--device", "cpu", "--torch-profile", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_json_gz_path_gets_the_steps_chrome_trace(tmp_path):
    trace = tmp_path / "step.json.gz"
    _profiled_run(tmp_path, trace)
    with gzip.open(trace, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    names = {event.get("name") for event in events if event.get("cat") == "cpu_op"}
    assert "aten::mm" in names or "aten::addmm" in names


def test_torch_profile_writes_the_last_steps_operator_table(tmp_path):
    table = tmp_path / "step.txt"
    _profiled_run(tmp_path, table)
    text = table.read_text()
    assert "Self CPU" in text
    assert "aten::mm" in text or "aten::addmm" in text  # the step's matmuls were profiled
    assert "Optimizer.step" in text or "_fused_adamw" in text or "adamw" in text.lower()


def test_a_torch_profile_path_without_a_folder_is_one_clear_error(tmp_path, capsys):
    import pytest

    from hexiseq.runtime import train

    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--plan", "p.json", "--torch-profile", str(tmp_path / "no" / "t.txt")])
    assert exit_info.value.code == 2
    assert "--torch-profile: no folder" in capsys.readouterr().err
