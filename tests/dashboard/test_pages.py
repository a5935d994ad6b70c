"""Every page through Streamlit's AppTest, on an empty and on a populated store, with the
app's own `st.navigation`; and the what-if page running a search."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from hexiseq.dashboard import _session
from hexiseq.dashboard.views import plan as plan_views
from hexiseq.plan import Plan
from hexiseq.store import Store

APP = Path(__file__).parents[2] / "dashboard" / "app.py"
PAGES = ("plan", "cluster", "memory", "throughput", "profiles", "whatif")
TIMEOUT_S = 60


def open_page(store_url: str, page: str, **state) -> AppTest:
    """The app run once (to register its pages), then switched to `page` and run again."""
    app = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    app.session_state[_session.STORE_URL_KEY] = store_url
    for key, value in state.items():
        app.session_state[key] = value
    app.run()
    app.switch_page(f"screens/{page}.py").run()
    return app


def texts(app: AppTest) -> str:
    """Everything the page says in markdown, info, warning, error and caption elements."""
    parts = [
        e.value
        for kind in ("markdown", "info", "warning", "error", "caption")
        for e in getattr(app, kind)
    ]
    return "\n".join(str(p) for p in parts)


def assert_no_exception(app: AppTest) -> None:
    assert not app.exception, [e.value for e in app.exception]


@pytest.mark.parametrize("page", PAGES)
def test_page_on_an_empty_store_says_how_to_get_data(page, empty_store_url):
    app = open_page(empty_store_url, page)
    assert_no_exception(app)
    said = texts(app)
    expected = {
        "plan": "hexiseq plan --cluster",
        "cluster": "hexiseq plan --cluster",
        "memory": "hexiseq plan --cluster",
        "throughput": "hexiseq run --plan",
        "profiles": "hexiseq profile",
        "whatif": "run the search",
    }[page]
    assert expected in said


@pytest.mark.parametrize("page", PAGES)
def test_page_on_a_populated_store_renders(page, populated_store):
    app = open_page(populated_store.url, page)
    assert_no_exception(app)
    assert not app.error, [e.value for e in app.error]
    if page in ("plan", "cluster", "memory", "throughput", "profiles"):
        assert "hexiseq plan --cluster" not in texts(app)  # the data is there, no hint
        assert "hexiseq profile" not in texts(app)
        assert app.get("plotly_chart"), "no figure drawn"


def test_profiles_page_shows_the_fit_and_its_heldout_error(populated_store):
    app = open_page(populated_store.url, "profiles")
    assert app.selectbox(key="profile_family").options == ["cpu gemm float32", "intra:cpu p2p"]
    heldout = next(d.value for d in app.dataframe if "extrapolation_error_pct" in d.value)
    assert list(heldout["family"]) == ["cpu gemm float32", "intra:cpu p2p"]
    app.selectbox(key="profile_family").set_value("intra:cpu p2p").run()
    assert_no_exception(app)
    # The store's runtime run measured peaks: they are drawn against the memory model.
    assert "Memory calibration" in [header.value for header in app.subheader]
    assert any("Not calibrated yet" in caption.value for caption in app.caption)


def test_plan_page_compares_two_saved_plans(populated_store):
    with Store.open(populated_store.url) as store:
        other = next(r.id for r in store.list_plans() if r.label == "ring-only")
    app = open_page(populated_store.url, "plan", compare_choice=f"store:{other}")
    assert_no_exception(app)
    table = next(d.value for d in app.dataframe if "shown plan" in d.value.columns)
    assert table.loc["name", "second plan"] == "ring-only"
    assert table.loc["name", "shown plan"] == "hexiseq"


def test_throughput_page_shows_the_runtime_run(populated_store):
    app = open_page(populated_store.url, "throughput")
    runs = next(d.value for d in app.dataframe if "measured_step_s" in d.value.columns)
    assert len(runs) == 1
    assert runs.iloc[0]["measured_over_predicted"] == pytest.approx(1.5)


def replans_table(app: AppTest):
    return next(d.value for d in app.dataframe if "predicted_gain" in d.value.columns)


def test_throughput_page_shows_the_replan(populated_store):
    app = open_page(populated_store.url, "throughput")
    assert_no_exception(app)
    assert "Re-plans (hexiseq run)" in [header.value for header in app.subheader]
    (replan,) = replans_table(app).to_dict("records")
    assert (replan["launch"], replan["step"], replan["reason"]) == ("launch-test", 3, "drift")
    assert replan["plan_change"].endswith(" -> 4 ranks, 4 HP groups of 1")  # to ring-only
    assert replan["predicted_gain"] == pytest.approx(1.25)
    assert replan["measured_gain"] == pytest.approx(1.2)
    assert "replan_gains" in [chart.key for chart in app.get("plotly_chart")]
    assert "No re-plans in the store" not in texts(app)


def test_throughput_page_on_a_store_without_replans_says_what_records_them(empty_store_url):
    app = open_page(empty_store_url, "throughput")
    assert_no_exception(app)
    assert "No re-plans in the store. `hexiseq run --replan` re-plans when" in texts(app)


def test_replans_of_several_launches_show_one_launch_when_picked(
    empty_store_url, tiny_result, make_drift_replan
):
    best, ring = tiny_result.best, tiny_result.baselines["ring-only"]
    with Store.open(empty_store_url) as store:
        store.save_replan(make_drift_replan(best, ring))
        store.save_replan(
            make_drift_replan(best, ring, launch_id="launch-other", reason="lost", lost_ranks=(3,))
        )
    app = open_page(empty_store_url, "throughput")
    assert_no_exception(app)
    assert list(replans_table(app)["launch"]) == ["launch-other", "launch-test"]
    # Picked through the state: AppTest cannot set a widget of this page (it calls the
    # Optuna-storage box's format_func outside a run).
    app = open_page(empty_store_url, "throughput", replan_launch="launch-test")
    assert_no_exception(app)
    assert app.selectbox(key="replan_launch").value == "launch-test"
    assert list(replans_table(app)["launch"]) == ["launch-test"]


def test_uploaded_plan_is_shown(empty_store_url, tiny_result):
    uploads = {"mine.json": tiny_result.best.to_json_text()}
    app = open_page(empty_store_url, "memory", **{_session.UPLOADS_KEY: uploads})
    assert_no_exception(app)
    assert app.sidebar.selectbox[0].value == "upload:mine.json"
    assert app.get("plotly_chart")


def test_a_bad_store_url_is_one_error_line():
    app = open_page("mysql://nobody@nowhere/db", "plan")
    assert_no_exception(app)
    assert len(app.error) == 1 and "mysql" in app.error[0].value


def test_whatif_search_shows_its_result_everywhere_and_saves_it(empty_store_url):
    app = open_page(empty_store_url, "whatif")
    app.selectbox(key="whatif_cluster").set_value("cpu-emulated-2type")
    app.selectbox(key="whatif_model").set_value("tiny")
    app.text_input(key="whatif_seq_len").set_value("8k")
    app.button[0].click().run()  # the form's submit button
    assert_no_exception(app)
    result = app.session_state[_session.WHATIF_KEY]["result"]
    assert result.best.model.name == "tiny"
    assert app.sidebar.selectbox[0].value == _session.WHATIF_CHOICE
    assert "Result: tiny on cpu-emulated-2type" in app.subheader[0].value
    app.button(key="whatif_save").click().run()
    assert_no_exception(app)
    with Store.open(empty_store_url) as store:
        labels = sorted(r.label for r in store.list_plans())
    assert labels == ["best", "ring-only", "ulysses-only", "uniform-usp"]
    app.switch_page("screens/throughput.py").run()
    assert_no_exception(app)
    assert len(app.get("plotly_chart")) >= 2  # plan vs baselines, search history


WIDGET_KINDS = ("selectbox", "text_input", "number_input", "radio", "checkbox", "button")


def without_widget_state(app: AppTest, page: str) -> AppTest:
    """`page` run in a fresh AppTest holding the session's own state (`st.session_state`) but
    none of its widgets' state: what is left when Streamlit deletes the state of widgets a run
    did not draw."""
    widget_keys = {w.key for kind in WIDGET_KINDS for w in app.get(kind)}
    later = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    for key, value in app.session_state.items():
        if key not in widget_keys:
            later.session_state[key] = value
    later.run()
    later.switch_page(f"screens/{page}.py").run()
    return later


def test_the_plan_picked_in_the_sidebar_stays_picked_on_every_page(populated_store):
    """It reset to the newest plan on each page switch: a user read another plan's memory."""
    with Store.open(populated_store.url) as store:
        oldest = min(r.id for r in store.list_plans())
    app = open_page(populated_store.url, "plan")
    newest = app.sidebar.selectbox[0].value
    chosen = f"store:{oldest}"
    assert chosen != newest
    app.sidebar.selectbox[0].set_value(chosen).run()  # the user's pick in the sidebar
    assert f"from store plan #{oldest}:" in texts(app)
    # Throughput last: AppTest cannot call its Optuna-storage box's format_func outside a run.
    for page in ("memory", "cluster", "whatif", "profiles", "plan", "throughput"):
        app.switch_page(f"screens/{page}.py").run()
        assert_no_exception(app)
        assert app.sidebar.selectbox[0].value == chosen, page
        if page == "plan":
            assert f"from store plan #{oldest}:" in texts(app)  # and draws that plan
            # Streamlit drops a widget's state after a run that did not draw it: the pick
            # must come back all the same.
            later = without_widget_state(app, "memory")
            assert_no_exception(later)
            assert later.sidebar.selectbox[0].value == chosen, "after the widget state went"


def search_tiny(app: AppTest, seq_len: str = "8k", cost_model: str = "auto") -> AppTest:
    """Fill the what-if form (the tiny model on the 2-type CPU cluster) and submit it."""
    app.selectbox(key="whatif_cluster").set_value("cpu-emulated-2type")
    app.selectbox(key="whatif_model").set_value("tiny")
    app.text_input(key="whatif_seq_len").set_value(seq_len)
    app.radio(key="whatif_cost_model").set_value(cost_model)
    return app.button[0].click().run()  # the form's submit button


def assert_no_whatif_result(app: AppTest) -> None:
    """No result, no Save button, and no what-if plan to pick in the sidebar."""
    assert not [b for b in app.button if b.key == "whatif_save"]  # nothing to save
    assert not [h for h in app.subheader if h.value.startswith("Result")]
    assert _session.WHATIF_KEY not in app.session_state
    assert all(_session.WHATIF_CHOICE not in box.options for box in app.sidebar.selectbox)


def test_a_whatif_error_clears_the_previous_result_and_its_save_button(empty_store_url):
    """A failed search left the previous result on screen with a live Save button: a wrong
    plan was saved that way."""
    app = search_tiny(open_page(empty_store_url, "whatif"))
    assert [b.key for b in app.button if b.key == "whatif_save"] == ["whatif_save"]
    assert app.sidebar.selectbox[0].value == _session.WHATIF_CHOICE
    search_tiny(app, seq_len="8kk")
    assert_no_exception(app)
    assert len(app.error) == 1 and "8kk" in app.error[0].value
    assert_no_whatif_result(app)
    app.run()  # and it stays gone on the next run
    assert_no_whatif_result(app)
    with Store.open(empty_store_url) as store:
        assert store.list_plans() == []


def test_a_cluster_error_on_the_whatif_page_clears_the_previous_result(
    empty_store_url, monkeypatch
):
    """The cluster edited into something invalid (a node row left empty): one error line, and
    the previous result goes with its Save button."""
    from hexiseq.dashboard.views import whatif as whatif_views
    from hexiseq.errors import InputError

    app = search_tiny(open_page(empty_store_url, "whatif"))
    assert [b.key for b in app.button if b.key == "whatif_save"] == ["whatif_save"]

    def invalid(*_args):
        raise InputError("cluster edited: node 3 has no GPU type")

    monkeypatch.setattr(whatif_views, "edited_cluster", invalid)
    app.run()
    assert_no_exception(app)
    assert [e.value for e in app.error] == ["cluster edited: node 3 has no GPU type"]
    assert_no_whatif_result(app)


@pytest.mark.parametrize("page", ["plan", "cluster", "memory", "throughput", "whatif"])
def test_every_page_with_predictions_says_which_cost_model_made_them(page, populated_store):
    """It showed only on the Plan page: the other pages' numbers did not say whether they were
    the datasheet's or a fit's. One caption, from one helper, on each page."""
    with Store.open(populated_store.url) as store:
        newest = max(r.id for r in store.list_plans() if r.label == "best")
        plan = Plan.from_json_text(store.get_plan_json(newest))
    app = open_page(populated_store.url, page)
    if page == "whatif":  # its predictions are the search's: run one (the datasheet's)
        search_tiny(app, cost_model="datasheet")
        plan = app.session_state[_session.WHATIF_KEY]["result"].best
    assert_no_exception(app)
    line = plan_views.prediction_source_line(plan)
    assert line.startswith(f"Predictions of {plan.name}: ")
    assert [c.value for c in app.caption].count(line) == 1, texts(app)


def test_a_128_gpu_plan_page_shows_nodes_then_one_nodes_ranks(empty_store_url):
    from hexiseq import plan_search

    plan = plan_search("mix4-128", "llama3-8b", "1M").best
    assert plan.cluster.world_size == 128
    uploads = {"large.json": plan.to_json_text()}
    app = open_page(empty_store_url, "plan", **{_session.UPLOADS_KEY: uploads})
    assert_no_exception(app)
    assert [s.value for s in app.subheader][:1] == ["Nodes"]
    nodes = next(d.value for d in app.dataframe if "memory_fraction_max" in d.value.columns)
    devices = next(d.value for d in app.dataframe if "token_ranges" in d.value.columns)
    assert len(nodes) == len(plan.cluster.nodes)
    assert len(devices) == plan.cluster.nodes[0].count  # node 0's ranks, not all 128
    app.selectbox(key="plan_node").set_value(plan.cluster.nodes[-1].name).run()
    devices = next(d.value for d in app.dataframe if "token_ranges" in d.value.columns)
    assert list(devices["node"].unique()) == [plan.cluster.nodes[-1].name]


def test_whatif_plans_with_the_stores_fitted_model(populated_store):
    """It ignored a fitted model in the store: the plan was always the datasheet's."""
    labels = {}
    for choice in ("datasheet", "auto"):
        app = open_page(populated_store.url, "whatif")
        app.selectbox(key="whatif_cluster").set_value("cpu-emulated-2type")
        app.selectbox(key="whatif_model").set_value("tiny")
        app.text_input(key="whatif_seq_len").set_value("8k")
        app.radio(key="whatif_cost_model").set_value(choice)
        app.button[0].click().run()
        assert_no_exception(app)
        labels[choice] = app.session_state[_session.WHATIF_KEY]["result"].best.cost_model_summary
    assert "fitted" not in labels["datasheet"]
    assert labels["auto"].startswith("fitted"), labels["auto"]
