"""Tests of a node's `memory_GiB` (gpu: cpu test clusters): parsed, validated, carried on
nodes and devices, round-tripped, and read as the rank's capacity everywhere (issue 12)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from cli_runner import run_main

import hexiseq
from hexiseq import Cluster, InputError, gpu_spec
from hexiseq.catalog import GiB
from hexiseq.costmodel import DatasheetCostModel, simulate_step
from hexiseq.costmodel.memory import MEMORY_LIMIT_FRACTION, memory_limit_bytes
from hexiseq.layout import build_uniform_layout
from hexiseq.model import ModelSpec, TrainSpec
from hexiseq.search._evaluate import Problem

CPU_NODES = (
    "name: c\n"
    "nodes:\n"
    "  - {name: roomy, gpu: cpu, count: 2}\n"
    "  - {name: cramped, gpu: cpu, count: 1, memory_GiB: 0.5, emulation_slowdown: 2}\n"
    "network: {inter_node_GBps: 2.0}\n"
)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _one_node(memory: str, gpu: str = "cpu") -> str:
    return f"name: c\nnodes:\n  - {{name: n0, gpu: {gpu}, count: 2, memory_GiB: {memory}}}\n"


def test_memory_GiB_is_carried_on_node_and_devices(tmp_path):
    cluster = Cluster.from_yaml(_write(tmp_path, CPU_NODES))
    assert [node.memory_GiB for node in cluster.nodes] == [None, 0.5]
    assert [(d.node, d.memory_GiB) for d in cluster.devices] == [
        ("roomy", None),
        ("roomy", None),
        ("cramped", 0.5),
    ]
    assert cluster.devices[2].emulation_slowdown == 2.0


def test_gpu_of_a_rank_has_its_node_memory_and_the_catalog_otherwise(tmp_path):
    cluster = Cluster.from_yaml(_write(tmp_path, CPU_NODES))
    catalog = gpu_spec("cpu")
    assert cluster.gpu(0) == catalog
    assert cluster.gpu(2).memory_GiB == 0.5
    assert cluster.gpu(2).memory_bytes == GiB // 2
    # Everything else of the spec is the catalog's.
    assert cluster.gpu(2).peak_flops == catalog.peak_flops
    assert cluster.gpu(2).hbm_GBps == catalog.hbm_GBps
    assert gpu_spec("cpu").memory_GiB == catalog.memory_GiB  # the catalog is untouched


def test_integer_memory_GiB_is_a_float(tmp_path):
    cluster = Cluster.from_yaml(_write(tmp_path, _one_node("3")))
    assert cluster.nodes[0].memory_GiB == 3.0
    assert cluster.gpu(1).memory_bytes == 3 * GiB


def test_to_dict_writes_memory_GiB_only_when_set_and_round_trips(tmp_path):
    cluster = Cluster.from_yaml(_write(tmp_path, CPU_NODES))
    nodes = cluster.to_dict()["nodes"]
    assert "memory_GiB" not in nodes[0]
    assert nodes[1]["memory_GiB"] == 0.5
    again = Cluster.from_dict(cluster.to_dict())
    assert again == cluster
    assert again.devices == cluster.devices
    assert again.gpu(2) == cluster.gpu(2)
    assert again.to_dict() == cluster.to_dict()


def test_cluster_without_memory_GiB_differs_from_one_with_it(tmp_path):
    with_memory = Cluster.from_yaml(_write(tmp_path, CPU_NODES))
    document = with_memory.to_dict()
    del document["nodes"][1]["memory_GiB"]
    assert Cluster.from_dict(document) != with_memory


def test_plan_json_keeps_memory_GiB(tmp_path):
    cluster = Cluster.from_yaml(_write(tmp_path, CPU_NODES))
    plan = hexiseq.plan_search(cluster, "tiny", 96, activation_checkpointing=False).best
    again = hexiseq.Plan.from_json_text(plan.to_json_text())
    assert again.cluster == cluster
    assert again.cluster.gpu(2).memory_GiB == 0.5


# (id, file text, regex the message must contain after "cluster file PATH: ")
BAD_MEMORY = [
    (
        "on-a-gpu-node",
        _one_node("8", gpu="H100-SXM"),
        r"nodes\[0\]: memory_GiB is for gpu: cpu test clusters only \(node 'n0' has gpu "
        r"H100-SXM, whose memory is the catalog's 80 GiB\)$",
    ),
    (
        "zero",
        _one_node("0"),
        r"nodes\[0\]\.memory_GiB: must be a positive number of GiB \(node 'n0' has 0\)$",
    ),
    (
        "negative",
        _one_node("-2.5"),
        r"nodes\[0\]\.memory_GiB: must be a positive number of GiB \(node 'n0' has -2\.5\)$",
    ),
    (
        "infinite",
        _one_node(".inf"),
        r"nodes\[0\]\.memory_GiB: input should be a finite number \(got inf\)$",
    ),
    (
        "not-a-number",
        _one_node(".nan"),
        r"nodes\[0\]\.memory_GiB: input should be a finite number \(got nan\)$",
    ),
    (
        "a-string",
        _one_node("'4'"),
        r"nodes\[0\]\.memory_GiB: input should be a valid number \(got '4'\)$",
    ),
    (
        "a-bool",
        _one_node("true"),
        r"nodes\[0\]\.memory_GiB: input should be a valid number \(got True\)$",
    ),
    (
        "with-units",
        _one_node("4GiB"),
        r"nodes\[0\]\.memory_GiB: input should be a valid number \(got '4GiB'\)$",
    ),
]


@pytest.mark.parametrize(
    ("text", "problem"),
    [case[1:] for case in BAD_MEMORY],
    ids=[case[0] for case in BAD_MEMORY],
)
def test_bad_memory_GiB_fails_with_one_line_naming_the_field(tmp_path, text, problem):
    path = _write(tmp_path, text)
    with pytest.raises(InputError, match=re.escape(f"cluster file {path}: ") + problem) as info:
        Cluster.from_yaml(path)
    assert "\n" not in str(info.value)
    assert "(and " not in str(info.value)  # one problem, not a cascade
    assert info.value.__cause__ is None


def test_bad_memory_GiB_in_a_dict_names_the_source():
    document = {"name": "c", "nodes": [{"name": "n", "gpu": "cpu", "count": 1, "memory_GiB": -1}]}
    with pytest.raises(
        InputError, match=r"^cluster: nodes\[0\]\.memory_GiB: must be a positive number"
    ):
        Cluster.from_dict(document)


# --- capacity is read by rank ---------------------------------------------------------------


def _two_node_cluster(memory_GiB: float) -> Cluster:
    return Cluster.from_dict(
        {
            "name": "c",
            "nodes": [
                {"name": "a", "gpu": "cpu", "count": 1},
                {"name": "b", "gpu": "cpu", "count": 1, "memory_GiB": memory_GiB},
            ],
            "network": {"inter_node_GBps": 2.0},
        }
    )


def test_simulator_capacity_is_the_rank_memory():
    cluster = _two_node_cluster(1.25)
    model = ModelSpec.preset("tiny")
    train = TrainSpec(seq_len=64, activation_checkpointing=False)
    layout = build_uniform_layout(64, model.heads, model.kv_heads, [1, 1])
    prediction = simulate_step(cluster, model, train, layout, DatasheetCostModel())
    assert prediction.memory_capacity_bytes == (gpu_spec("cpu").memory_bytes, int(1.25 * GiB))


def test_search_limits_are_per_rank():
    cluster = _two_node_cluster(0.75)
    problem = Problem(
        cluster, ModelSpec.preset("tiny"), TrainSpec(seq_len=64), DatasheetCostModel()
    )
    assert problem.limits() == [
        memory_limit_bytes(gpu_spec("cpu").memory_bytes),
        memory_limit_bytes(int(0.75 * GiB)),
    ]


def test_plan_reports_each_rank_capacity_and_a_too_small_node_is_infeasible():
    plan = hexiseq.plan_search(_two_node_cluster(2.0), "tiny", 64).best
    capacities = [rank.memory_capacity_bytes for rank in plan.predicted.ranks]
    assert capacities == [gpu_spec("cpu").memory_bytes, 2 * GiB]
    with pytest.raises(hexiseq.InfeasibleError, match=r"rank 1 \(cpu on b\)"):
        hexiseq.plan_search(_two_node_cluster(0.001), "tiny", 64)


# --- the CLI plans uneven shares for a YAML cluster with memory_GiB ---------------------------


def _cramped_cluster_yaml(tmp_path: Path) -> Path:
    """Three CPU ranks, the last with room beside the rest of its even-plan memory for only a
    tenth of the model states: even shares (a third each) do not fit there."""
    nodes = [{"name": f"n{i}", "gpu": "cpu", "count": 1} for i in range(3)]
    document = {"name": "cramped", "nodes": nodes, "network": {"inter_node_GBps": 2.0}}
    even = hexiseq.plan_search(
        Cluster.from_dict(document), "tiny", 128, activation_checkpointing=False
    ).best
    last = even.predicted.ranks[-1]
    states = sum(rank.memory_terms["model_states"] for rank in even.predicted.ranks)
    room = last.memory_bytes - last.memory_terms["model_states"] + 0.1 * states
    nodes[-1]["memory_GiB"] = room / MEMORY_LIMIT_FRACTION / GiB
    return _write(tmp_path, yaml.safe_dump(document))


def test_cli_plan_gives_uneven_state_shares_on_a_cluster_with_memory_GiB(tmp_path):
    cluster_file, out = _cramped_cluster_yaml(tmp_path), tmp_path / "plan.json"
    argv = ["plan", "--cluster", str(cluster_file), "--model", "tiny", "--seq-len", "128"]
    run = run_main([*argv, "--checkpointing", "off", "--no-store", "--out", str(out)])
    assert run.code == 0, run.stderr
    assert "state_sharding=MILP (by memory)" in run.stdout
    plan = hexiseq.Plan.from_json(out)
    fractions = [a.state_fraction for a in plan.assignments]
    assert fractions[-1] < 0.1 + 1e-9 < 1 / 3 < max(fractions)
    assert plan.knobs["state_sharding"].startswith("MILP (by memory)")
    assert plan.cluster == Cluster.from_yaml(cluster_file)
    assert plan.predicted.ranks[-1].memory_capacity_bytes == plan.cluster.gpu(2).memory_bytes
