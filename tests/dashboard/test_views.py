"""The pure view builders: figures and tables checked against the plans they draw."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
import pytest

from hexiseq.catalog import GiB
from hexiseq.costmodel.memory import MEMORY_LIMIT_FRACTION
from hexiseq.dashboard.views import cluster as cluster_views
from hexiseq.dashboard.views import memory as memory_views
from hexiseq.dashboard.views import plan as plan_views
from hexiseq.dashboard.views import records as record_views
from hexiseq.dashboard.views import throughput as throughput_views
from hexiseq.store import PlanRecord, RuntimeMeasurement


def bar_intervals(figure) -> list[tuple[str, float, float]]:
    """(row label, start, end) of every horizontal bar of every bar trace."""
    return [
        (label, base, base + length)
        for trace in figure.data
        if trace.type == "bar"
        for label, base, length in zip(trace.y, trace.base, trace.x)
    ]


def test_segments_figure_covers_every_token_exactly_once(tiny_result, oom_result):
    for plan in (tiny_result.best, oom_result.best):
        intervals = sorted(bar_intervals(plan_views.segments_figure(plan)), key=lambda i: i[1])
        position = 0
        for _, start, end in intervals:
            assert start == position and end > start
            position = end
        assert position == plan.train.seq_len


def test_segments_figure_rows_are_the_ranks_own_ranges(tiny_result):
    plan = tiny_result.best
    intervals = bar_intervals(plan_views.segments_figure(plan))
    for rank, ranges in enumerate(plan.attention_layout.token_ranges):
        label = plan_views.rank_label(plan, rank)
        drawn = sorted((s, e) for row, s, e in intervals if row == label)
        assert drawn == sorted(ranges)
    groups = {trace.name for trace in plan_views.segments_figure(plan).data}
    assert groups == {f"group {g}" for g in range(len(plan.attention_layout.groups))}


def test_heads_figure_partitions_the_heads_inside_each_group(oom_result):
    plan = oom_result.best
    figure = plan_views.heads_figure(plan)
    for group, trace in enumerate(figure.data):
        spans = sorted(zip(trace.base, np.add(trace.base, trace.x)))
        assert spans[0][0] == 0 and spans[-1][1] == plan.model.heads
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert len(spans) == len(plan.attention_layout.groups[group])


def test_time_breakdown_sums_to_each_ranks_total(oom_result):
    plan = oom_result.best
    figure = plan_views.time_breakdown_figure(plan)
    assert [trace.name for trace in figure.data] == list(plan_views.TIME_PARTS.values())
    totals = np.sum([np.asarray(trace.x, dtype=float) for trace in figure.data], axis=0)
    expected = [rank.step_s for rank in plan.predicted.ranks]
    np.testing.assert_allclose(totals, expected, rtol=1e-12)
    assert list(figure.data[0].y) == [
        plan_views.rank_label(plan, r) for r in range(plan.cluster.world_size)
    ]


def test_assignments_frame_matches_the_plan(tiny_result):
    plan = tiny_result.best
    frame = plan_views.assignments_frame(plan)
    assert list(frame["tokens"]) == [a.tokens for a in plan.assignments]
    assert frame["tokens"].sum() == plan.train.seq_len
    assert list(frame["heads"]) == [a.heads for a in plan.assignments]


def test_compare_frame_puts_plans_side_by_side(tiny_result):
    best, ring = tiny_result.best, tiny_result.baselines["ring-only"]
    frame = plan_views.compare_plans_frame({"a": best, "b": ring})
    assert list(frame.columns) == ["a", "b"]
    assert frame.loc["name", "b"] == ring.name
    assert float(frame.loc["tokens_per_s", "a"]) == best.predicted.tokens_per_s


def test_memory_figure_marks_the_95_percent_limit_of_each_device(oom_result):
    plan = oom_result.best
    figure = memory_views.memory_figure(plan)
    limit = next(trace for trace in figure.data if trace.name == "95 % limit")
    capacities = [rank.memory_capacity_bytes for rank in plan.predicted.ranks]
    np.testing.assert_allclose(limit.x, [MEMORY_LIMIT_FRACTION * c / GiB for c in capacities])
    capacity = next(trace for trace in figure.data if trace.name == "capacity")
    np.testing.assert_allclose(capacity.x, [c / GiB for c in capacities])
    assert len(set(capacities)) > 1  # a mixed cluster: the limit differs per device


def test_memory_terms_add_up_to_the_used_memory(oom_result):
    plan = oom_result.best
    figure = memory_views.memory_figure(plan)
    bars = [t for t in figure.data if t.type == "bar"]
    assert [t.name for t in bars] == list(memory_views.MEMORY_TERMS.values())
    stacked = np.sum([np.asarray(t.x, dtype=float) for t in bars], axis=0)
    used = [rank.memory_bytes / GiB for rank in plan.predicted.ranks]
    np.testing.assert_allclose(stacked, used, rtol=1e-9)


def test_memory_terms_are_recomputed_when_the_plan_lacks_them(tiny_result):
    plan = tiny_result.best
    ranks = tuple(
        type(r)(**{**{f: getattr(r, f) for f in r.__dataclass_fields__}, "memory_terms": {}})
        for r in plan.predicted.ranks
    )
    bare = type(plan)(
        **{
            **plan.__dict__,
            "predicted": type(plan.predicted)(
                plan.predicted.step_time_s,
                plan.predicted.tokens_per_s,
                ranks,
                plan.predicted.cost_model,
            ),
        }
    )
    assert memory_views.memory_terms_bytes(bare) == memory_views.memory_terms_bytes(plan)


def test_oom_baselines_are_flagged_with_what_they_need(oom_result):
    plan = oom_result.best
    frame = memory_views.baseline_memory_frame(plan, oom_result.baselines)
    assert set(frame[frame["candidate"] == plan.name]["status"]) == {"fits"}
    for name, baseline in oom_result.baselines.items():
        rows = frame[frame["candidate"] == name]
        assert set(rows["status"]) == {"OOM"}
        assert sorted(rows["rank"]) == sorted(baseline.missing_bytes)
        for row in rows.itertuples():
            capacity = plan.predicted.ranks[int(row.rank)].memory_capacity_bytes
            assert row.memory_GiB > MEMORY_LIMIT_FRACTION * capacity / GiB
    figure = memory_views.baseline_memory_figure(plan, oom_result.baselines)
    oom_traces = [t for t in figure.data if t.type == "bar" and "OOM" in t.name]
    assert len(oom_traces) == len(oom_result.baselines) == 4
    assert all(set(t.text) == {"OOM"} for t in oom_traces)


def test_feasible_baselines_show_their_predicted_memory(tiny_result):
    plan, ring = tiny_result.best, tiny_result.baselines["ring-only"]
    frame = memory_views.baseline_memory_frame(plan, tiny_result.baselines)
    rows = frame[frame["candidate"] == "ring-only"]
    assert list(rows["memory_GiB"]) == [r.memory_bytes / GiB for r in ring.predicted.ranks]


def test_rule_breaking_baseline_is_listed_with_its_reason():
    from hexiseq import plan_search

    result = plan_search("cpu-emulated-2type", "tiny-7h", 8192)
    frame = memory_views.baseline_memory_frame(result.best, result.baselines)
    row = frame[frame["candidate"] == "ulysses-only"].iloc[0]
    assert row["status"] == "infeasible" and "divisible" in row["reason"]
    throughput = throughput_views.throughput_frame(result.best, result.baselines)
    assert throughput.set_index("candidate").loc["ulysses-only", "status"] == "infeasible"


def test_link_heatmap_holds_every_node_pair(oom_result):
    cluster = oom_result.best.cluster
    frame = cluster_views.link_bandwidth_frame(cluster)
    names = [node.name for node in cluster.nodes]
    for a in names:
        for b in names:
            assert frame.loc[a, b] == cluster.link_GBps(a, b)
    assert [frame.loc[n, n] for n in names] == [node.intra_node_GBps for node in cluster.nodes]
    figure = cluster_views.link_heatmap_figure(cluster)
    np.testing.assert_array_equal(figure.data[0].z, frame.to_numpy())


def test_devices_and_nodes_frames_count_every_device(oom_result):
    cluster = oom_result.best.cluster
    assert len(cluster_views.devices_frame(cluster)) == cluster.world_size
    assert cluster_views.nodes_frame(cluster)["devices"].sum() == cluster.world_size


def test_ring_hops_follow_the_ring_order(oom_result):
    plan = oom_result.best
    hops = cluster_views.ring_hops_frame(plan)
    groups = plan.attention_layout.groups
    assert len(hops) == len(groups)
    assert list(hops["next_group"]) == [(g + 1) % len(groups) for g in range(len(groups))]
    assert hops["segment_tokens"].sum() == plan.train.seq_len
    nodes = [plan.cluster.devices[members[0]].node for members in groups]
    expected = [
        plan.cluster.link_GBps(nodes[g], nodes[(g + 1) % len(groups)]) for g in range(len(groups))
    ]
    assert list(hops["hop_GBps"]) == expected
    figure = cluster_views.ring_order_figure(plan)
    arrows = [a for a in figure.layout.annotations if a.showarrow]
    assert len(arrows) == len(groups)


def test_throughput_frame_gives_the_plans_speedup(tiny_result, oom_result):
    frame = throughput_views.throughput_frame(tiny_result.best, tiny_result.baselines)
    for name, speedup in zip(frame["candidate"][1:], frame["plan_speedup"][1:]):
        assert speedup == pytest.approx(tiny_result.speedup_over(name))
    oom = throughput_views.throughput_frame(oom_result.best, oom_result.baselines)
    assert list(oom["status"]) == ["fits", "OOM", "OOM", "OOM", "OOM"]
    figure = throughput_views.throughput_figure(oom)
    assert list(figure.data[0].text[1:]) == ["OOM"] * 4
    assert list(figure.data[0].y[1:]) == [0, 0, 0, 0]


def test_search_history_keeps_the_best_so_far():
    frame = throughput_views.search_history_frame([3.0, None, 5.0, 0.0, 4.0])
    assert list(frame["best_so_far"]) == [3.0, 3.0, 5.0, 5.0, 5.0]
    assert frame["tokens_per_s"].isna().tolist() == [False, True, False, True, False]
    figure = throughput_views.search_history_figure(frame)
    assert list(figure.data[2].x) == [1, 3]  # the infeasible trials


def test_study_values_skip_unfinished_trials():
    class State:
        def __init__(self, name):
            self.name = name

    class Trial:
        def __init__(self, state, values):
            self.state, self.values = State(state), values

    trials = [Trial("COMPLETE", [1.0, 0.2]), Trial("FAIL", None), Trial("COMPLETE", [2.0])]
    assert throughput_views.study_values(trials) == [(1.0, 0.2), None, (2.0,)]


def test_pareto_front_keeps_the_non_dominated_points():
    frame = throughput_views.pareto_frame([(1.0, 0.5), (2.0, 0.4), (1.5, 0.3), (2.0, 0.4)])
    assert list(frame["on_front"]) == [True, True, False, True]
    figure = throughput_views.pareto_figure(frame)
    assert list(figure.data[1].x) == [1.0, 2.0, 2.0]


def test_runs_frame_compares_measured_with_predicted(tiny_result):
    plan = tiny_result.best
    measured_s = 1.5 * plan.predicted.step_time_s
    measurements = [
        RuntimeMeasurement(
            r,
            step,
            measured_s * (3 if step == 0 else 1),
            0.8 * measured_s,
            1000 + r,
            "cpu_max_rss",
            "cpu",
            1.0,
            1.0,
            "none",
        )
        for step in range(3)
        for r in range(plan.cluster.world_size)
    ]
    run = {"id": 7, "plan_name": plan.name, "world_size": 4, "device": "cpu", "emulation": 1}
    run |= {"status": "failed", "failure": "torchrun exited with code 1"}
    frame = throughput_views.runs_frame([run], {7: measurements}, {7: plan})
    row = frame.iloc[0]
    assert (row["status"], row["failure"]) == ("failed", "torchrun exited with code 1")
    assert row["measured_step_s"] == pytest.approx(measured_s)  # the warm-up step left out
    assert row["measured_over_predicted"] == pytest.approx(1.5)
    assert row["steps_measured"] == 3
    ranks = throughput_views.rank_measured_frame(plan, measurements)
    assert list(ranks["measured_peak_GiB"]) == [(1000 + r) / GiB for r in range(4)]
    unknown = throughput_views.runs_frame([run], {7: measurements}, {7: None})
    assert unknown.iloc[0]["measured_over_predicted"] is None
    figure = throughput_views.predicted_vs_measured_figure(frame)
    assert list(figure.data[0].y) == [pytest.approx(measured_s)]


def record(plan_id: int, label: str, model: str = "tiny") -> PlanRecord:
    when = datetime(2025, 1, 1, tzinfo=timezone.utc)
    return PlanRecord(plan_id, when, label, "c", model, 8192, 1.0, 1.0, "datasheet estimate")


def test_baselines_are_the_records_saved_after_their_plan():
    records = [
        record(1, "best"),
        record(2, "uniform-usp"),
        record(3, "ring-only"),
        record(4, "best"),
        record(5, "ring-only"),
        record(6, "best", model="other"),
        record(7, "ring-only", model="tiny"),
    ]
    assert record_views.baseline_ids_of(1, records) == {"uniform-usp": 2, "ring-only": 3}
    assert record_views.baseline_ids_of(4, records) == {"ring-only": 5}
    assert record_views.baseline_ids_of(6, records) == {}
    assert record_views.baseline_ids_of(99, records) == {}
    frame = record_views.plans_frame(records)
    assert list(frame["id"]) == [r.id for r in records] and frame["seq_len"][0] == "8K"
    assert record_views.plan_choice_label(records[0]) == "#1 best: tiny on c, 8K"


def test_the_data_parallel_replicas_row_says_hexiseq_cannot_run_them():
    from hexiseq import plan_search

    result = plan_search("h100x8-a100x8", "llama-30b", "128k")
    frame = throughput_views.throughput_frame(result.best, result.baselines, result.data_parallel)
    row = frame[frame["candidate"] == "data-parallel replicas"].iloc[0]
    assert row["tokens_per_s"] == pytest.approx(result.data_parallel.tokens_per_s)
    assert row["plan_speedup"] == pytest.approx(result.speedup_over_data_parallel())
    assert f"a batch of {result.data_parallel.sequences} sequences" in row["reason"]


@pytest.fixture(scope="module")
def large_plan():
    from hexiseq import plan_search

    return plan_search("mix4-128", "llama3-8b", "1M").best


def test_a_large_plan_is_summarised_one_row_per_node(large_plan):
    from hexiseq.dashboard.views import plan as plan_views

    frame = plan_views.node_summary_frame(large_plan)
    nodes = large_plan.cluster.nodes
    assert large_plan.cluster.world_size == 128
    assert list(frame["node"]) == [n.name for n in nodes]
    assert list(frame["devices"]) == [n.count for n in nodes]
    assert frame["tokens"].sum() == sum(a.tokens for a in large_plan.assignments)
    first = plan_views.node_ranks(large_plan)[nodes[0].name]
    assert frame.iloc[0]["slowest_busy_s"] == max(large_plan.predicted.ranks[r].busy_s
                                                  for r in first)  # fmt: skip
    assert (frame["memory_GiB_min"] <= frame["memory_GiB_max"]).all()
    assert 0 < frame["memory_fraction_max"].max() <= 0.95


def test_a_large_plans_figures_show_one_nodes_ranks(large_plan):
    from hexiseq.dashboard.views import plan as plan_views

    ranks = plan_views.node_ranks(large_plan)[large_plan.cluster.nodes[1].name]
    for figure in (plan_views.segments_figure(large_plan, ranks),
                   plan_views.heads_figure(large_plan, ranks),
                   plan_views.time_breakdown_figure(large_plan, ranks)):  # fmt: skip
        shown = {label for trace in figure.data for label in trace.y}
        assert shown == {plan_views.rank_label(large_plan, r) for r in ranks}
        assert figure.layout.height == 160 + 22 * len(ranks)
    assert list(plan_views.assignments_frame(large_plan, ranks)["rank"]) == ranks


def with_cost_model(plan, cost_model: dict[str, str]):
    """The plan as if `cost_model` (GPU type -> label) had predicted it."""
    import dataclasses

    return dataclasses.replace(
        plan, predicted=dataclasses.replace(plan.predicted, cost_model=cost_model)
    )


def test_prediction_source_line_says_datasheet_or_fitted(tiny_result):
    plan = tiny_result.best
    line = plan_views.prediction_source_line
    assert line(
        with_cost_model(plan, {"H100-SXM": "datasheet estimate", "A100-80G": "datasheet estimate"})
    ) == (  # fmt: skip
        f"Predictions of {plan.name}: datasheet estimate"
    )
    assert line(with_cost_model(plan, {"cpu": "measured CPU peak"})) == (
        f"Predictions of {plan.name}: datasheet: measured CPU peak"
    )
    mixed = {"H100-SXM": "fitted (profile run 3, 2026-11-22)", "A100-80G": "datasheet estimate"}
    assert line(with_cost_model(plan, mixed)) == (
        f"Predictions of {plan.name}: H100-SXM fitted (profile run 3, 2026-11-22); "
        "A100-80G datasheet estimate"
    )
    assert "not recorded" in line(with_cost_model(plan, {}))


def test_cost_model_kind_of_every_label():
    assert plan_views.cost_model_kind("fitted (profile run 1, 2026-11-22)") == "fitted"
    assert plan_views.cost_model_kind("datasheet estimate") == "datasheet"
    assert plan_views.cost_model_kind("measured CPU peak") == "datasheet"


@pytest.fixture(scope="module")
def replica_plan():
    """A plan of data-parallel replicas: a batch of 3 on the emulated 2-type cluster."""
    from hexiseq.search import plan_search

    plan = plan_search("cpu-emulated-2type", "tiny", 256, micro_batches=3).best
    assert plan.data_parallel
    return plan


def test_each_replicas_segments_cover_every_token_once(replica_plan):
    frame = plan_views.segments_frame(replica_plan)
    for replica in replica_plan.replicas:
        mine = frame[frame["rank"].isin(replica.ranks)].sort_values("start")
        assert list(mine["start"]) == [0, *list(mine["end"])[:-1]]
        assert mine["end"].max() == replica_plan.train.seq_len


def test_replica_views_name_each_ranks_replica(replica_plan):
    assignments = plan_views.assignments_frame(replica_plan)
    assert list(assignments["replica"]) == [a.replica for a in replica_plan.assignments]
    rings = cluster_views.ring_hops_frame(replica_plan)
    groups = sum(len(r.layout.groups) for r in replica_plan.replicas)
    assert len(rings) == groups and set(rings["replica"]) == {0, 1}
    for _, row in rings.iterrows():  # each ring's ranks are its replica's
        ranks = {int(rank) for rank in row["ranks"].split(", ")}
        assert ranks <= set(replica_plan.replicas[row["replica"]].ranks)
    summary = plan_views.plan_summary(replica_plan)
    assert (summary["replicas"], summary["sequences_per_step"]) == (2, 3)
    assert len(memory_views.memory_frame(replica_plan)) == replica_plan.cluster.world_size
