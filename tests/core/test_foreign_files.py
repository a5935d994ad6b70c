"""Files and databases that are not hexiseq's get one clear error and are left untouched."""

from __future__ import annotations

import sqlite3
from importlib import resources

import pytest

from hexiseq import Cluster, Plan
from hexiseq.errors import InputError
from hexiseq.store import Store
from hexiseq.units import MAX_SEQ_LEN, parse_seq_len


def test_a_foreign_sqlite_database_is_refused_and_not_written(tmp_path):
    path = tmp_path / "theirs.db"
    with sqlite3.connect(path) as connection:
        connection.execute("create table plans (id integer primary key, x text)")
    with pytest.raises(InputError, match=r"not a hexiseq store: it holds tables \(plans\)"):
        Store.open(f"sqlite:///{path}")
    with sqlite3.connect(path) as connection:
        tables = [row[0] for row in connection.execute("select name from sqlite_master")]
    assert tables == ["plans"]


def test_a_new_empty_database_becomes_a_store(tmp_path):
    path = tmp_path / "new.db"
    sqlite3.connect(path).close()  # an empty file: nobody's tables yet
    store = Store.open(f"sqlite:///{path}")
    assert store.list_plans() == []


@pytest.mark.parametrize("loader", ["cluster", "plan"])
def test_files_that_are_not_utf8_are_one_line(tmp_path, loader):
    path = tmp_path / ("c.yaml" if loader == "cluster" else "p.json")
    path.write_bytes(b"\xff\xfe\x00not text")
    with pytest.raises(InputError, match="not UTF-8 text") as caught:
        Cluster.from_yaml(path) if loader == "cluster" else Plan.from_json(path)
    assert "\n" not in str(caught.value)


def test_sequence_lengths_have_an_upper_limit():
    assert parse_seq_len(MAX_SEQ_LEN) == MAX_SEQ_LEN
    with pytest.raises(InputError, match="beyond the longest sequence"):
        parse_seq_len(MAX_SEQ_LEN + 2)
    with pytest.raises(InputError, match="beyond the longest sequence"):
        parse_seq_len(10**20)


@pytest.fixture(scope="module")
def plan_document():
    from hexiseq import plan_search

    return plan_search("cpu-emulated-2type", "tiny", 8192).best.to_dict()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["assignments"][0].update(tokens=d["assignments"][0]["tokens"] + 64),
            "tokens",
        ),
        (lambda d: d["assignments"][1].update(gpu="H100-SXM"), "H100-SXM on"),
        (
            lambda d: [a.update(state_fraction=5.0) for a in d["assignments"]],
            "state fractions add up to 20",
        ),
        (lambda d: d["assignments"][2].update(state_fraction=-0.5), "state_fraction -0.5"),
        (lambda d: d["predicted"].update(step_time_s=float("nan")), "step_time_s is nan"),
        (lambda d: d["predicted"]["ranks"][0].update(linear_s=-1.0), "negative or not finite"),
    ],
)
def test_a_hand_edited_plan_that_contradicts_itself_is_refused(plan_document, edit, message):
    import copy
    import json

    document = copy.deepcopy(plan_document)
    edit(document)
    with pytest.raises(InputError, match="inconsistent plan") as caught:
        Plan.from_json_text(json.dumps(document), source="edited.json")
    assert message in str(caught.value)


def test_writing_a_plan_over_an_old_one_on_a_full_disk_keeps_the_old_one(
    tmp_path, plan_document, monkeypatch
):
    import errno
    import os

    plan = Plan.from_dict(plan_document)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    before = path.read_bytes()

    def full_disk(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        plan.to_json(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary left


@pytest.mark.parametrize(
    ("network", "field"),
    [
        ({"inter_node_GBps": 1e-300}, "network.inter_node_GBps"),
        ({"inter_node_GBps": 1e12}, "network.inter_node_GBps"),
        ({"inter_node_GBps": 50, "inter_node_latency_us": 1e12}, "inter_node_latency_us"),
        ({"inter_node_GBps": 50, "overrides": [{"a": "a", "b": "b", "GBps": 0.0}]}, "GBps"),
    ],
)
def test_implausible_links_are_refused(network, field):
    nodes = [
        {"name": "a", "gpu": "H100-SXM", "count": 2},
        {"name": "b", "gpu": "A100-80G", "count": 2},
    ]
    with pytest.raises(InputError, match=field):
        Cluster.from_dict({"name": "x", "nodes": nodes, "network": network})


@pytest.mark.parametrize("name", ["gpus.yaml", "models.yaml"])
def test_packaged_yaml_reads_the_same_with_either_loader(name):
    """hexiseq's own YAML goes through libyaml where PyYAML has it (`PACKAGED_LOADER`, for a
    quick start), a user's files through PyYAML's loader: the documents must be the same."""
    import yaml

    from hexiseq._yaml import read_packaged_yaml

    text = resources.files("hexiseq").joinpath("data", name).read_text("utf-8")
    assert read_packaged_yaml(name) == yaml.load(text, Loader=yaml.SafeLoader)
