"""Tests of hexiseq.cluster: loading clusters from YAML, dicts and presets (docs/design.md §2)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hexiseq import Cluster, InputError, cluster_presets, gpu_spec

TWO_NODES = (
    "name: c\n"
    "nodes:\n"
    "  - {name: n0, gpu: H100-SXM, count: 8}\n"
    "  - {name: n1, gpu: A100-80G, count: 4}\n"
)

ALL_GPUS = (
    "V100-32G, A100-40G, A100-80G, A800-80G, H100-SXM, H100-PCIe, H800, H200, L40S, "
    "RTX-3090, RTX-4090, B200, MI300X, cpu"
)

# (id, file text, regex the message must contain after "cluster file PATH: ")
BAD_CLUSTER_FILES = [
    (
        "unknown-gpu",
        "name: c\nnodes:\n  - {name: n0, gpu: H999, count: 8}\n",
        rf"nodes\[0\]\.gpu: unknown GPU 'H999'; allowed: {re.escape(ALL_GPUS)}$",
    ),
    (
        "gpu-name-is-case-sensitive",
        "name: c\nnodes:\n  - {name: n0, gpu: h100-sxm, count: 8}\n",
        r"nodes\[0\]\.gpu: unknown GPU 'h100-sxm'; allowed: .*H100-SXM",
    ),
    (
        "negative-inter-node-bandwidth",
        TWO_NODES + "network: {inter_node_GBps: -5}\n",
        r"network\.inter_node_GBps: input should be greater than or equal to "
        r"0\.000001 \(got -5\)$",
    ),
    (
        "negative-intra-node-bandwidth",
        "name: c\nnodes:\n  - {name: n0, gpu: H100-SXM, count: 8, intra_node_GBps: -1}\n",
        r"nodes\[0\]\.intra_node_GBps: input should be greater than or equal to "
        r"0\.000001 \(got -1\)$",
    ),
    (
        "zero-override-bandwidth",
        TWO_NODES + "network: {inter_node_GBps: 5, overrides: [{a: n0, b: n1, GBps: 0}]}\n",
        r"network\.overrides\[0\]\.GBps: input should be greater than or equal to "
        r"0\.000001 \(got 0\)$",
    ),
    (
        "zero-count",
        "name: c\nnodes:\n  - {name: n0, gpu: H100-SXM, count: 0}\n",
        r"nodes\[0\]\.count: input should be greater than or equal to 1 \(got 0\)$",
    ),
    (
        "count-not-a-number",
        "name: c\nnodes:\n  - {name: n0, gpu: H100-SXM, count: eight}\n",
        r"nodes\[0\]\.count: input should be a valid integer.*\(got 'eight'\)$",
    ),
    (
        "missing-gpu-on-second-node",
        "name: c\nnodes:\n  - {name: n0, gpu: H100-SXM, count: 8}\n  - {name: n1, count: 8}\n"
        "network: {inter_node_GBps: 5}\n",
        r"nodes\[1\]\.gpu: required field is missing$",
    ),
    (
        "missing-nodes",
        "name: c\n",
        r"nodes: required field is missing$",
    ),
    (
        "empty-nodes",
        "name: c\nnodes: []\n",
        r"nodes: list should have at least 1 item",
    ),
    (
        "unknown-node-key",
        "name: c\nnodes:\n  - {name: n0, gpu: H100-SXM, count: 8, colour: red}\n",
        r"nodes\[0\]\.colour: unknown key; "
        r"allowed keys: name, gpu, count, intra_node_GBps, emulation_slowdown, memory_GiB, "
        r"measured_slowdown$",
    ),
    (
        "unknown-top-level-key",
        TWO_NODES + "networks: {inter_node_GBps: 5}\n",
        r"networks: unknown key; allowed keys: name, nodes, network$",
    ),
    (
        "unknown-network-key",
        TWO_NODES + "network: {inter_node_GBps: 5, speed: 3}\n",
        r"network\.speed: unknown key; "
        r"allowed keys: inter_node_GBps, inter_node_latency_us, overrides$",
    ),
    (
        "unknown-override-key",
        TWO_NODES
        + "network: {inter_node_GBps: 5, overrides: [{a: n0, b: n1, GBps: 3, via: x}]}\n",
        r"network\.overrides\[0\]\.via: unknown key; allowed keys: a, b, GBps$",
    ),
    (
        "duplicate-node-names",
        "name: c\nnodes:\n  - {name: n0, gpu: H100-SXM, count: 8}\n"
        "  - {name: n0, gpu: A100-80G, count: 8}\nnetwork: {inter_node_GBps: 5}\n",
        r"node names must be unique; repeated: n0$",
    ),
    (
        "override-names-unknown-node",
        TWO_NODES + "network: {inter_node_GBps: 5, overrides: [{a: n0, b: n9, GBps: 3}]}\n",
        r"network\.overrides names unknown node 'n9'; nodes: n0, n1$",
    ),
    (
        "multi-node-without-network",
        TWO_NODES,
        r"network is required when there is more than one node$",
    ),
    (
        "emulation-slowdown-on-gpu",
        "name: c\nnodes:\n  - {name: n0, gpu: H100-SXM, count: 8, emulation_slowdown: 2}\n",
        r"nodes\[0\]: emulation_slowdown is for gpu: cpu test clusters only "
        r"\(node 'n0' has gpu H100-SXM\)$",
    ),
    (
        "emulation-slowdown-below-one",
        "name: c\nnodes:\n  - {name: n0, gpu: cpu, count: 2, emulation_slowdown: 0.5}\n",
        r"nodes\[0\]\.emulation_slowdown: input should be greater than or equal to 1",
    ),
    (
        "malformed-yaml-bad-indent",
        "name: c\nnodes:\n  - name: n0\n    gpu: H100-SXM\n   count: 8\n",
        r"not valid YAML at line 5, column 4: ",
    ),
    (
        "malformed-yaml-unclosed-brace",
        "name: c\nnodes:\n  - {name: n0, gpu: H100-SXM, count: 8\nnetwork: {inter_node_GBps: 5}\n",
        r"not valid YAML at line 4, column 8: expected ',' or '}'",
    ),
    (
        "top-level-list",
        "- {name: n0, gpu: H100-SXM, count: 8}\n",
        r"expected a mapping with keys name, nodes, network; got list$",
    ),
    (
        "empty-file",
        "",
        r"expected a mapping with keys name, nodes, network; got NoneType$",
    ),
]


def _write(tmp_path: Path, text: str, name: str = "bad-cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("text", "problem"),
    [case[1:] for case in BAD_CLUSTER_FILES],
    ids=[case[0] for case in BAD_CLUSTER_FILES],
)
def test_bad_cluster_file_fails_with_one_line_naming_file_field_and_allowed(
    tmp_path, text, problem
):
    path = _write(tmp_path, text)
    with pytest.raises(InputError, match=re.escape(f"cluster file {path}: ") + problem) as info:
        Cluster.from_yaml(path)
    assert "\n" not in str(info.value)
    # The user sees the message, not a chain of pydantic/yaml exceptions.
    assert info.value.__cause__ is None


def test_bad_cluster_files_are_distinct_inputs():
    texts = [case[1] for case in BAD_CLUSTER_FILES]
    assert len(set(texts)) == len(texts) >= 8


def test_missing_cluster_file_names_the_file(tmp_path):
    path = tmp_path / "absent" / "cluster.yaml"
    with pytest.raises(
        InputError, match=re.escape(f"cluster file {path}: cannot be read (No such file")
    ) as info:
        Cluster.from_yaml(path)
    assert "\n" not in str(info.value)


def test_several_problems_report_the_first_and_count_the_rest(tmp_path):
    path = _write(tmp_path, "name: c\nnodes:\n  - {name: n0, gpu: H999, count: 0}\n")
    with pytest.raises(InputError, match=r"unknown GPU 'H999'.* \(and 1 more problem\)$"):
        Cluster.from_yaml(path)


def test_from_dict_rejects_non_mapping_and_names_its_source():
    with pytest.raises(InputError, match=r"^my source: expected a mapping .*; got str$"):
        Cluster.from_dict("h100x8", source="my source")
    with pytest.raises(InputError, match=r"^cluster: nodes\[0\]\.count: .*greater than"):
        Cluster.from_dict({"name": "c", "nodes": [{"name": "n", "gpu": "cpu", "count": -1}]})


def test_unknown_preset_lists_presets():
    with pytest.raises(InputError, match=r"unknown cluster preset 'h100x9'; presets: .*h100x8"):
        Cluster.preset("h100x9")


def test_load_takes_preset_name_yaml_path_or_fails_listing_presets(tmp_path):
    assert Cluster.load("h100x8").name == "h100x8"
    path = _write(tmp_path, "name: mine\nnodes:\n  - {name: n0, gpu: L40S, count: 2}\n", "c.yml")
    assert Cluster.load(str(path)).name == "mine"
    # An existing file is read as YAML whatever its suffix.
    other = _write(tmp_path, "name: noext\nnodes:\n  - {name: n0, gpu: B200, count: 1}\n", "c")
    assert Cluster.load(str(other)).gpu_types == ["B200"]
    with pytest.raises(InputError, match=r"cluster file .*missing\.yaml: cannot be read"):
        Cluster.load(str(tmp_path / "missing.yaml"))
    with pytest.raises(
        InputError, match=r"--cluster 'no-such' is neither a YAML file nor a preset; presets: "
    ):
        Cluster.load("no-such")


# --- good clusters ------------------------------------------------------------------------------


def test_presets_include_design_examples():
    presets = cluster_presets()
    assert {"h100x8-a100x8", "mix4-32", "cpu-emulated-2type"} <= set(presets)
    assert all(path.suffix == ".yaml" and path.is_file() for path in presets.values())


@pytest.mark.parametrize("name", sorted(cluster_presets()))
def test_every_preset_loads_with_consistent_devices(name):
    cluster = Cluster.preset(name)
    assert cluster.name == name
    devices = cluster.devices
    assert len(devices) == cluster.world_size == sum(node.count for node in cluster.nodes)
    assert [d.rank for d in devices] == list(range(cluster.world_size))
    for rank in range(cluster.world_size):
        assert cluster.gpu(rank).name == devices[rank].gpu


def test_h100x8_a100x8_preset():
    cluster = Cluster.preset("h100x8-a100x8")
    assert cluster.world_size == 16
    assert cluster.gpu_types == ["H100-SXM", "A100-80G"]
    assert [d.gpu for d in cluster.devices] == ["H100-SXM"] * 8 + ["A100-80G"] * 8
    assert cluster.inter_node_GBps == 50
    assert cluster.link_GBps("h100-node", "a100-node") == 50
    assert cluster.link_GBps("h100-node", "h100-node") == 450  # NVLink4 from the catalog
    assert cluster.link_GBps("a100-node", "a100-node") == 300  # NVLink3 from the catalog


def test_mix4_32_preset():
    cluster = Cluster.preset("mix4-32")
    assert cluster.world_size == len(cluster.devices) == 32
    assert cluster.gpu_types == ["H200", "H100-SXM", "A100-80G", "L40S"]
    assert cluster.link_GBps("h200-node", "h100-node") == 50
    for other in ("h200-node", "h100-node", "a100-node"):
        assert cluster.link_GBps("l40s-node", other) == 25
        assert cluster.link_GBps(other, "l40s-node") == 25


def test_devices_are_ranked_node_by_node_in_file_order():
    cluster = Cluster.from_dict(
        {
            "name": "c",
            "nodes": [
                {"name": "x", "gpu": "A100-80G", "count": 2},
                {"name": "y", "gpu": "H100-SXM", "count": 3},
                {"name": "z", "gpu": "A100-80G", "count": 1},
            ],
            "network": {"inter_node_GBps": 25},
        }
    )
    assert [(d.rank, d.node, d.local_rank, d.gpu) for d in cluster.devices] == [
        (0, "x", 0, "A100-80G"),
        (1, "x", 1, "A100-80G"),
        (2, "y", 0, "H100-SXM"),
        (3, "y", 1, "H100-SXM"),
        (4, "y", 2, "H100-SXM"),
        (5, "z", 0, "A100-80G"),
    ]
    assert cluster.gpu_types == ["A100-80G", "H100-SXM"]  # first appearance, no repeats
    assert cluster.world_size == 6


def test_cpu_emulated_preset_carries_emulation_slowdown():
    cluster = Cluster.preset("cpu-emulated-2type")
    assert [(d.node, d.emulation_slowdown) for d in cluster.devices] == [
        ("fast", 1.0),
        ("fast", 1.0),
        ("slow", 2.0),
        ("slow", 2.0),
    ]


def test_intra_node_link_is_catalog_value_unless_overridden(tmp_path):
    path = _write(
        tmp_path,
        "name: c\n"
        "nodes:\n"
        "  - {name: a, gpu: H100-SXM, count: 8}\n"
        "  - {name: b, gpu: H100-SXM, count: 8, intra_node_GBps: 123.5}\n"
        "  - {name: c, gpu: L40S, count: 4}\n"
        "network: {inter_node_GBps: 40}\n",
        "links.yaml",
    )
    cluster = Cluster.from_yaml(path)
    assert cluster.link_GBps("a", "a") == gpu_spec("H100-SXM").intra_node_GBps == 450
    assert cluster.link_GBps("b", "b") == 123.5
    assert cluster.link_GBps("c", "c") == gpu_spec("L40S").intra_node_GBps == 32
    assert cluster.link_GBps("a", "b") == cluster.link_GBps("b", "c") == 40
    assert cluster.link_latency_s("a", "a") == pytest.approx(8e-6)  # catalog NVLink latency
    assert cluster.link_latency_s("a", "b") == pytest.approx(10e-6)  # default inter-node


def test_overrides_apply_to_both_directions_and_only_their_pair():
    cluster = Cluster.from_dict(
        {
            "name": "c",
            "nodes": [
                {"name": "a", "gpu": "A100-80G", "count": 1},
                {"name": "b", "gpu": "A100-80G", "count": 1},
                {"name": "c", "gpu": "A100-80G", "count": 1},
            ],
            "network": {
                "inter_node_GBps": 50,
                "inter_node_latency_us": 3,
                "overrides": [{"a": "a", "b": "b", "GBps": 12.5}],
            },
        }
    )
    assert cluster.link_GBps("a", "b") == cluster.link_GBps("b", "a") == 12.5
    assert cluster.link_GBps("a", "c") == cluster.link_GBps("c", "b") == 50
    assert cluster.link_latency_s("c", "a") == pytest.approx(3e-6)


def test_single_node_cluster_needs_no_network():
    cluster = Cluster.from_dict(
        {"name": "one", "nodes": [{"name": "n", "gpu": "MI300X", "count": 8}]}
    )
    assert cluster.world_size == 8
    assert cluster.link_GBps("n", "n") == 448


@pytest.mark.parametrize("name", sorted(cluster_presets()))
def test_to_dict_from_dict_round_trip(name):
    cluster = Cluster.preset(name)
    again = Cluster.from_dict(cluster.to_dict())
    assert again == cluster
    assert again.devices == cluster.devices
    assert again.to_dict() == cluster.to_dict()


def test_round_trip_keeps_overrides_and_explicit_intra_node_link():
    document = {
        "name": "c",
        "nodes": [
            {"name": "a", "gpu": "H800", "count": 2, "intra_node_GBps": 99.0},
            {"name": "b", "gpu": "cpu", "count": 2, "emulation_slowdown": 3.0},
        ],
        "network": {
            "inter_node_GBps": 7.0,
            "inter_node_latency_us": 4.0,
            "overrides": [{"a": "b", "b": "a", "GBps": 1.5}],
        },
    }
    cluster = Cluster.from_dict(document)
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    assert cluster.to_dict()["network"] == document["network"]
    assert cluster.link_GBps("a", "b") == 1.5
    assert cluster.devices[3].emulation_slowdown == 3.0


# --- edge cases found in review ---------------


def test_override_of_a_node_with_itself_is_rejected():
    with pytest.raises(InputError, match=r"overrides"):
        Cluster.from_dict(
            {
                "name": "c",
                "nodes": [
                    {"name": "a", "gpu": "A100-80G", "count": 1},
                    {"name": "b", "gpu": "A100-80G", "count": 1},
                ],
                "network": {"inter_node_GBps": 5, "overrides": [{"a": "a", "b": "a", "GBps": 1}]},
            }
        )


def test_two_overrides_of_one_pair_are_rejected():
    with pytest.raises(InputError, match=r"overrides"):
        Cluster.from_dict(
            {
                "name": "c",
                "nodes": [
                    {"name": "a", "gpu": "A100-80G", "count": 1},
                    {"name": "b", "gpu": "A100-80G", "count": 1},
                ],
                "network": {
                    "inter_node_GBps": 5,
                    "overrides": [
                        {"a": "a", "b": "b", "GBps": 1},
                        {"a": "b", "b": "a", "GBps": 7},
                    ],
                },
            }
        )


def test_infinite_bandwidth_is_rejected(tmp_path):
    path = _write(tmp_path, TWO_NODES + "network: {inter_node_GBps: .inf}\n")
    with pytest.raises(InputError, match=r"network\.inter_node_GBps"):
        Cluster.from_yaml(path)


def test_boolean_count_is_rejected(tmp_path):
    path = _write(tmp_path, "name: c\nnodes:\n  - {name: n0, gpu: H100-SXM, count: true}\n")
    with pytest.raises(InputError, match=r"nodes\[0\]\.count"):
        Cluster.from_yaml(path)


def test_intra_node_bandwidth_is_a_float_before_and_after_a_round_trip():
    cluster = Cluster.preset("h100x8")
    again = Cluster.from_dict(cluster.to_dict())
    assert type(cluster.nodes[0].intra_node_GBps) is type(again.nodes[0].intra_node_GBps) is float
