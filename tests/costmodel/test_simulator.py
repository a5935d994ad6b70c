"""Step simulator on cases small enough to work out by hand."""

from __future__ import annotations

import collections

import pytest

from hexiseq import Cluster, ModelSpec, TrainSpec, build_uniform_layout, build_zigzag_layout
from hexiseq.costmodel import DatasheetCostModel, simulate_step
from hexiseq.costmodel._state import LAYOUT_TABLES
from hexiseq.costmodel._traffic import all_to_all_bytes
from hexiseq.costmodel.simulator import shared_tables

# One layer, one head, head_dim 8: weights are tiny next to a 500-token K/V block, so the FSDP
# gather (464 weights x 2 B) never shows and the ring alone sets the step time.
ONE_HEAD = ModelSpec(
    name="one-head", layers=1, hidden=8, heads=1, kv_heads=1, head_dim=8, ffn_hidden=8, vocab=8
)
S = 1000  # tokens; 2 groups -> zigzag chunks of 250: group 0 owns [0,250) and [750,1000)


def two_node_cluster(bandwidth_GBps: float, slowdown: float = 1.0) -> Cluster:
    return Cluster.from_dict(
        {
            "name": "two",
            "nodes": [
                {"name": "a", "gpu": "cpu", "count": 1},
                {"name": "b", "gpu": "cpu", "count": 1, "emulation_slowdown": slowdown},
            ],
            "network": {"inter_node_GBps": bandwidth_GBps, "inter_node_latency_us": 0},
        }
    )


def test_slow_link_exposes_ring_transfers(round_cost):
    # Causal pairs per group (see module docstring): own block 125,250, other block 125,000.
    # Forward: step 0 computes 0.12525 s; the other block (500 tok x 2 (K,V) x 8 dims x 2 B =
    # 16,000 B) needs 16,000 B / 32,000 B/s = 0.5 s, so step 1 runs 0.5 -> 0.625.
    # Backward: step 0 2 x 0.12525 = 0.2505 s; K/V arrive at 0.5, step 1 runs 0.5 -> 0.75 (its
    # dK/dV accumulator starts at zero here, as in the runtime); then the FP32 dK/dV of the
    # partner's block (500 x 2 x 8 x 4 B = 32,000 B, 1.0 s) go home: 0.75 + 1.0 = 1.75.
    # Step = 0.625 + 1.75 (no recompute).
    cluster = two_node_cluster(bandwidth_GBps=32_000 / 1e9)
    layout = build_uniform_layout(S, 1, 1, [1, 1])
    train = TrainSpec(seq_len=S, activation_checkpointing=False)
    prediction = simulate_step(cluster, ONE_HEAD, train, layout, round_cost)
    assert prediction.step_time_s == pytest.approx(0.625 + 1.75, rel=1e-9)
    for rank in prediction.rank_times:
        assert rank.attention_s == pytest.approx(0.25025 + 0.5005, rel=1e-9)
        assert rank.ring_exposed_comm_s == pytest.approx(0.37475 + (1.75 - 0.5005), rel=1e-9)
        assert rank.all_to_all_s == 0.0
        assert rank.idle_s == pytest.approx(0.0, abs=1e-12)


def test_fast_link_hides_ring_transfers(round_cost):
    cluster = two_node_cluster(bandwidth_GBps=1e6)
    layout = build_uniform_layout(S, 1, 1, [1, 1])
    train = TrainSpec(seq_len=S, activation_checkpointing=False)
    prediction = simulate_step(cluster, ONE_HEAD, train, layout, round_cost)
    # Only compute: forward 0.25025 s, backward 0.5005 s.
    assert prediction.step_time_s == pytest.approx(0.75075, rel=1e-6)


def test_slow_device_makes_everyone_wait(round_cost):
    # Rank 1 computes 2x slower. Forward: rank 1 finishes 0.2505 + 0.25 = 0.5005 while rank 0
    # is done at 0.25025 and idles. Backward: rank 1's steps take 0.501 and 0.5; rank 0's
    # second step ends only when rank 1's dK/dV arrive (0.501); both finish when rank 1's
    # block gradients return at 1.001. Step = 0.5005 + 1.001.
    cluster = two_node_cluster(bandwidth_GBps=1e6, slowdown=2.0)
    layout = build_uniform_layout(S, 1, 1, [1, 1])
    train = TrainSpec(seq_len=S, activation_checkpointing=False)
    prediction = simulate_step(cluster, ONE_HEAD, train, layout, round_cost)
    fast, slow = prediction.rank_times
    assert prediction.step_time_s == pytest.approx(1.5015, rel=1e-6)
    assert slow.attention_s == pytest.approx(2 * 0.75075, rel=1e-9)
    assert fast.attention_s == pytest.approx(0.75075, rel=1e-9)
    assert fast.idle_s + fast.ring_exposed_comm_s == pytest.approx(1.5015 - 0.75075, rel=1e-6)


def test_balanced_uneven_segments_beat_even_ones_on_a_slow_device(round_cost):
    cluster = two_node_cluster(bandwidth_GBps=1e6, slowdown=2.0)
    train = TrainSpec(seq_len=1200, activation_checkpointing=False)
    even = build_uniform_layout(1200, 1, 1, [1, 1])
    # Segment work is proportional to segment length under the generalized zigzag:
    # give the 2x slower rank half the tokens of the fast one.
    balanced = build_zigzag_layout(1200, 1, 1, [[0], [1]], [800, 400], [[1], [1]], [[1], [1]])
    even_s = simulate_step(cluster, ONE_HEAD, train, even, round_cost).step_time_s
    balanced_s = simulate_step(cluster, ONE_HEAD, train, balanced, round_cost).step_time_s
    assert balanced_s < 0.8 * even_s


def test_checkpointing_adds_one_forward(round_cost):
    cluster = two_node_cluster(bandwidth_GBps=1e6)
    layout = build_uniform_layout(S, 1, 1, [1, 1])
    plain = simulate_step(
        cluster, ONE_HEAD, TrainSpec(seq_len=S, activation_checkpointing=False), layout, round_cost
    )
    recompute = simulate_step(cluster, ONE_HEAD, TrainSpec(seq_len=S), layout, round_cost)
    assert recompute.step_time_s - plain.step_time_s == pytest.approx(0.25025, rel=1e-6)


def test_breakdown_adds_up_to_step_time():
    cluster = Cluster.preset("h100x8-a100x8")
    model = ModelSpec.preset("llama3-8b")
    layout = build_uniform_layout(128 * 1024, model.heads, model.kv_heads, [4, 4, 4, 4])
    prediction = simulate_step(
        cluster, model, TrainSpec(seq_len=128 * 1024), layout, DatasheetCostModel()
    )
    for rank in prediction.rank_times:
        parts = rank.to_dict().values()
        assert all(part >= -1e-9 for part in parts)
        assert sum(parts) == pytest.approx(prediction.step_time_s, rel=1e-9)
    assert prediction.tokens_per_s == pytest.approx(128 * 1024 / prediction.step_time_s)
    assert prediction.cost_model_labels == {
        "H100-SXM": "datasheet estimate",
        "A100-80G": "datasheet estimate",
    }


def test_all_to_all_bytes_follow_heads_and_gqa():
    # 4 heads, 2 KV heads (ratio 2) over 2 ranks with uneven heads 3 + 1: rank 0 needs KV
    # heads [0, 2), rank 1 KV head [1, 2) — head 1 is sent to both (GQA boundary).
    layout = build_zigzag_layout(40, 4, 2, [[0, 1]], [40], [[1, 1]], [[3, 1]])
    matrix = all_to_all_bytes(layout, (0, 1), head_dim=8, q_heads=True, kv=True)
    tokens = [layout.num_tokens(0), layout.num_tokens(1)]  # 20 each
    assert matrix[0, 1] == tokens[0] * (1 + 2 * 1) * 8 * 2
    assert matrix[1, 0] == tokens[1] * (3 + 2 * 2) * 8 * 2
    assert matrix[0, 0] == matrix[1, 1] == 0


def test_rejects_a_layout_for_another_world_size(round_cost):
    layout = build_uniform_layout(S, 1, 1, [1, 1, 1])
    with pytest.raises(ValueError, match="3 ranks but cluster two has 2 devices"):
        simulate_step(two_node_cluster(1.0), ONE_HEAD, TrainSpec(seq_len=S), layout, round_cost)


def test_backward_dkv_routes_keeper_to_keeper_with_folds():
    # 4 heads / 2 K/V heads, two groups of two ranks with heads 3 + 1: rank 0 holds K/V heads
    # [0, 2), rank 1 [1, 2). Head 1's keeper is rank 0 (lowest holder); rank 1 folds its
    # partial of head 1 into rank 0, and only keepers exchange dK/dV between groups.
    from hexiseq.costmodel._traffic import dkv_ring_senders, fold_links, ring_senders

    layout = build_zigzag_layout(
        80, 4, 2, [[0, 1], [2, 3]], [40, 40], [[1, 1], [1, 1]], [[3, 1], [3, 1]]
    )
    folds = fold_links(layout)
    assert list(zip(folds.folders, folds.keepers, folds.heads)) == [(1, 0, 1), (3, 2, 1)]
    dkv = dkv_ring_senders(layout)
    assert list(dkv.kv_heads_in) == [2, 0, 2, 0]  # keepers take both heads; rank 1/3 none
    assert list(dkv.heads_out) == [2, 0, 2, 0]
    kv = ring_senders(layout)
    assert list(kv.kv_heads_in) == [2, 1, 2, 1]  # forward K/V reach every holder
    assert list(kv.heads_out) == [3, 0, 3, 0]  # keeper sends head 1 to both next holders


class _RecordingCost(DatasheetCostModel):
    """The datasheet model, keeping the block shapes the simulator asks attention times for."""

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "calls", [])

    def attention_time_s(self, gpu, pairs, heads, head_dim, *, backward, **shape):
        # the simulator's tables are [step, rank]: kept here [rank, step]
        self.calls.append((pairs.T, shape["q_tokens"].T, shape["kv_tokens"].T))
        return super().attention_time_s(gpu, pairs, heads, head_dim, backward=backward)


def test_ring_steps_pass_the_runtime_block_shapes():
    """Step 0 is the own block, a causal square of the segment; the other steps are one
    mask-free rectangle: queries x keys = pairs (runtime/_tiles.py for zigzag layouts)."""
    cluster = Cluster.preset("cpu-emulated-2type")
    model = ModelSpec.preset("tiny")
    segments = [3072, 2048, 2048, 1024]
    layout = build_zigzag_layout(
        sum(segments), 8, 2, [[0], [1], [2], [3]], segments, [[1]] * 4, [[8]] * 4
    )
    cost = _RecordingCost()
    simulate_step(cluster, model, TrainSpec(seq_len=sum(segments)), layout, cost)
    assert len(cost.calls) == 2  # forward and backward tables
    for pairs, q_tokens, kv_tokens in cost.calls:
        assert list(q_tokens[:, 0]) == segments and list(kv_tokens[:, 0]) == segments
        assert (pairs[:, 0] == [s * (s + 1) // 2 for s in segments]).all()
        assert abs(q_tokens[:, 1:] * kv_tokens[:, 1:] - pairs[:, 1:]).max() < 1e-6


def test_tables_shared_between_simulations_change_no_prediction():
    """Layouts with the same groups and heads reuse their ring-sender tables through `shared`;
    a layout with other heads gets its own. Every prediction equals an unshared simulation."""
    cluster = Cluster.from_dict(
        {
            "name": "four",
            "nodes": [
                {"name": "a", "gpu": "A100-80G", "count": 2},
                {"name": "b", "gpu": "H100-SXM", "count": 2},
            ],
            "network": {"inter_node_GBps": 25},
        }
    )
    model = ModelSpec(
        name="m", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn_hidden=512, vocab=64
    )
    train = TrainSpec(seq_len=4096, activation_checkpointing=False)
    groups, weights = [[0, 1], [2, 3]], [[1, 1], [1, 1]]
    layouts = [
        build_zigzag_layout(4096, 4, 2, groups, [1024, 3072], weights, [[3, 1], [2, 2]]),
        build_zigzag_layout(4096, 4, 2, groups, [2560, 1536], weights, [[3, 1], [2, 2]]),
        build_zigzag_layout(4096, 4, 2, groups, [2560, 1536], weights, [[2, 2], [1, 3]]),
    ]
    cost, shared = DatasheetCostModel(), {}
    for layout in layouts:
        alone = simulate_step(cluster, model, train, layout, cost)
        together = simulate_step(cluster, model, train, layout, cost, shared=shared)
        assert together.rank_times == alone.rank_times
        assert together.step_time_s == alone.step_time_s
    # the cluster's arrays and collective link once; every table of the groups and heads
    # (the ring's traffic, the all-to-all's padded groups and links, ...) once per head
    # split: two
    by_name = collections.Counter(key[0] for key in shared)
    assert by_name.pop("cluster arrays") == by_name.pop("domain link") == 1
    assert {"ring traffic", "fan links", "group arrays"} <= set(by_name)
    assert set(by_name.values()) == {2}


def test_tables_kept_by_whole_layout_serve_other_clusters_of_its_shape_unchanged():
    """Where `shared` keeps tables by whole layout (`shared_tables(by_layout=True)`: the
    baselines' grids on each GPU type's nodes), one layout simulated on two clusters of the
    same shape computes its ring's causal pairs once, read-only, and both predictions equal
    unshared simulations; a plain shared dict keeps no such table."""

    def pair_of(gpu: str) -> Cluster:
        nodes = [{"name": name, "gpu": gpu, "count": 2} for name in ("a", "b")]
        return Cluster.from_dict({"name": gpu, "nodes": nodes, "network": {"inter_node_GBps": 25}})

    model = ModelSpec(
        name="m", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn_hidden=512, vocab=64
    )
    train = TrainSpec(seq_len=4096, activation_checkpointing=False)
    layout = build_uniform_layout(4096, 4, 2, [2, 2])
    cost, by_layout, plain = DatasheetCostModel(), shared_tables(by_layout=True), shared_tables()
    for cluster in (pair_of("A100-80G"), pair_of("H100-SXM")):
        alone = simulate_step(cluster, model, train, layout, cost)
        for shared in (by_layout, plain):
            together = simulate_step(cluster, model, train, layout, cost, shared=shared)
            assert together.rank_times == alone.rank_times
            assert together.step_time_s == alone.step_time_s
    (table,) = by_layout[LAYOUT_TABLES].values()
    assert table.shape == (2, 2) and not table.flags.writeable
    assert LAYOUT_TABLES not in plain
