"""The cluster presets of the paper scenarios (benchmarks/paper_scenarios.py) load as stated."""

from __future__ import annotations

from collections import Counter

import pytest

from hexiseq import Cluster, InfeasibleError, cluster_presets, gpu_spec, plan_search

# preset -> (GPU count by type, nodes, GPUs per node)
PAPER_PRESETS = {
    "mix4-32-large": ({"B200": 8, "H200": 8, "H100-SXM": 8, "A100-80G": 8}, 4, {8}),
    "mix2-128": ({"H100-SXM": 64, "A100-80G": 64}, 16, {8}),
    "mix4-128": ({"H200": 32, "H100-SXM": 32, "A100-80G": 32, "L40S": 32}, 16, {8}),
    "h100x4-a100x12": ({"H100-SXM": 4, "A100-80G": 12}, 2, {4, 12}),
    "a100x16-l40sx8": ({"A100-80G": 16, "L40S": 8}, 3, {8}),
    "h100x8-a100x24": ({"H100-SXM": 8, "A100-80G": 24}, 4, {8}),
    "b200x16": ({"B200": 16}, 2, {8}),
}

# mixed preset -> homogeneous preset of about the same total dense BF16 FLOP/s
FLOP_PAIRS = {
    "h100x4-a100x12": "h100x8",
    "a100x16-l40sx8": "h100x8",
    "h100x8-a100x24": "h100x16",
    "mix4-32-large": "b200x16",
}


@pytest.mark.parametrize("name", sorted(PAPER_PRESETS))
def test_preset_has_the_advertised_gpus(name):
    counts, node_count, node_sizes = PAPER_PRESETS[name]
    assert name in cluster_presets()
    cluster = Cluster.preset(name)
    assert cluster.name == name
    assert Counter(d.gpu for d in cluster.devices) == Counter(counts)
    assert cluster.gpu_types == list(counts)
    assert len(cluster.nodes) == node_count
    assert {node.count for node in cluster.nodes} == node_sizes
    assert cluster.world_size == sum(counts.values())


def total_tflops(name: str) -> float:
    return sum(gpu_spec(d.gpu).dense_bf16_tflops for d in Cluster.preset(name).devices)


@pytest.mark.parametrize("mixed", sorted(FLOP_PAIRS))
def test_flop_matched_pairs_agree_within_3_percent(mixed):
    ratio = total_tflops(mixed) / total_tflops(FLOP_PAIRS[mixed])
    assert abs(ratio - 1) <= 0.03


def test_mix4_32_large_holds_llama3_70b_at_1m_tokens():
    # The chunked loss holds one chunk of logits, not all (14 B per logit at 128K vocabulary
    # before it), and fused AdamW no parameter-sized temporary: 1M tokens now fit.
    result = plan_search("mix4-32-large", "llama3-70b", "1M")
    assert result.best.predicted.max_memory_fraction <= 0.95


def test_llama3_70b_at_2m_tokens_is_refused_with_the_missing_memory():
    # The error says how much is missing and where instead of passing a plan that would die.
    with pytest.raises(InfeasibleError, match="GiB short"):
        plan_search("mix4-32-large", "llama3-70b", "2M")
