"""`hexiseq run` checks the devices it finds against the plan before any process group."""

from __future__ import annotations

import types

import pytest
import torch

from hexiseq import plan_search
from hexiseq.errors import InputError
from hexiseq.runtime.devices import check_run_devices


@pytest.fixture(scope="module")
def paper_plan():
    return plan_search("h100x8-a100x8", "llama3-8b", "128k").best


def fake_cuda(monkeypatch, names: list[str], memory_GiB: float = 80.0) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    props = types.SimpleNamespace(total_memory=int(memory_GiB * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)


def test_cuda_without_cuda_is_one_line(paper_plan, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InputError, match="finds no CUDA device here; use --device cpu"):
        check_run_devices(paper_plan, "cuda")
    check_run_devices(paper_plan, "auto")  # auto falls back to the CPU


def test_too_few_devices_are_refused(paper_plan, monkeypatch):
    fake_cuda(monkeypatch, ["NVIDIA H100 80GB HBM3"] * 8)
    with pytest.raises(InputError, match="16 ranks, one per device, but this machine has 8"):
        check_run_devices(paper_plan, "cuda")


def test_a_device_of_another_type_is_refused(paper_plan, monkeypatch):
    fake_cuda(monkeypatch, ["NVIDIA H100 80GB HBM3"] * 16)
    with pytest.raises(
        InputError, match="rank 8 is planned on a A100-80G but its device cuda:8 is"
    ):
        check_run_devices(paper_plan, "cuda")
    fake_cuda(monkeypatch, ["NVIDIA H100 80GB HBM3"] * 8 + ["NVIDIA A100-SXM4-80GB"] * 8)
    check_run_devices(paper_plan, "cuda")  # the devices the plan was made for


def test_a_node_launch_checks_only_that_nodes_devices(paper_plan, monkeypatch):
    """`hexiseq run --node-rank 1`: node 1's eight A100s are cuda:0..7 of its machine."""
    fake_cuda(monkeypatch, ["NVIDIA A100-SXM4-80GB"] * 8)
    check_run_devices(paper_plan, "cuda", node_rank=1)
    with pytest.raises(
        InputError, match="rank 0 is planned on a H100-SXM but its device cuda:0 is"
    ):
        check_run_devices(paper_plan, "cuda", node_rank=0)
    fake_cuda(monkeypatch, ["NVIDIA A100-SXM4-80GB"] * 4)
    with pytest.raises(InputError, match=r"8 ranks on node 1 \(a100-node\), one per"):
        check_run_devices(paper_plan, "cuda", node_rank=1)
