import subprocess
import sys

from hexiseq import Cluster, ModelSpec
from hexiseq.search import plan_search


def test_torch_profile_writes_the_last_steps_operator_table(tmp_path):
    cluster = Cluster.from_dict(
        {"name": "one", "nodes": [{"name": "n0", "gpu": "cpu", "count": 1}]}
    )
    plan = plan_search(cluster, ModelSpec.preset("tiny"), 256, seed=0).best
    plan_path, table = tmp_path / "plan.json", tmp_path / "step.txt"
    plan.to_json(plan_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "1", "-m", "hexiseq.runtime.train", "--plan", str(plan_path)]
    command += ["--steps", "2", "--no-store", "--device", "cpu", "--torch-profile", str(table)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
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
