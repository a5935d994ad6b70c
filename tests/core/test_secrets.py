"""Secrets (docs/design.md §9): the store URL comes from `--store`, else $HEXISEQ_STORE_URL, else
the default, for every command; children get it in their environment, never their argv; no
output, error or dashboard page shows a password; the dashboard opens only the operator's
databases."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import run_main

from hexiseq.cli import main
from hexiseq.cli import profile as _cli_profile
from hexiseq.errors import InputError
from hexiseq.search import plan_search
from hexiseq.store import (
    DEFAULT_STORE_URL,
    OPTUNA_STORAGE_ENV,
    STORE_URL_ENV,
    Store,
    mask_url_passwords,
    store_url_from,
)

SECRET = "s3cret"
UNREACHABLE = f"postgresql://u:{SECRET}@127.0.0.1:1/db"
PLAN_ARGS = ["plan", "--cluster", "cpu-emulated-2type", "--model", "tiny", "--seq-len", "8k"]
V1_PLAN = str(Path(__file__).parent / "data" / "plan_v1_llama3.2-3b_8k.json")
APP = Path(__file__).parents[2] / "dashboard" / "app.py"


@pytest.fixture(autouse=True)
def no_store_in_environment(monkeypatch):
    monkeypatch.delenv(STORE_URL_ENV, raising=False)
    monkeypatch.delenv(OPTUNA_STORAGE_ENV, raising=False)


def assert_one_secret_free_line(run) -> None:
    assert run.code == 2, run
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("hexiseq: error: "), run.stderr
    assert SECRET not in run.stderr + run.stdout


# --- where the URL comes from -------------------------------------------------------------


def test_store_url_precedence_is_argument_then_environment_then_default():
    environ = {STORE_URL_ENV: "sqlite:///from-env.db"}
    assert store_url_from("sqlite:///given.db", environ) == "sqlite:///given.db"
    assert store_url_from(None, environ) == "sqlite:///from-env.db"
    assert store_url_from(None, {STORE_URL_ENV: ""}) == DEFAULT_STORE_URL
    assert store_url_from(None, {}) == DEFAULT_STORE_URL


def test_store_open_without_url_reads_the_environment(monkeypatch, tmp_path):
    url = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv(STORE_URL_ENV, url)
    with Store.open() as store:
        assert store.url == url
    assert (tmp_path / "env.db").is_file()


@pytest.mark.parametrize("where", ["argument", "environment", "neither"])
def test_every_command_takes_the_store_from_the_environment(where, monkeypatch, tmp_path):
    """`fit` on a store that does not exist names the store it looked for in its one error
    line (and creates none)."""
    monkeypatch.chdir(tmp_path)
    given, from_env = f"sqlite:///{tmp_path / 'given.db'}", f"sqlite:///{tmp_path / 'env.db'}"
    argv = ["fit"]
    if where == "argument":
        argv += ["--store", given]
    if where != "neither":
        monkeypatch.setenv(STORE_URL_ENV, from_env)
    expected = {"argument": given, "environment": from_env, "neither": DEFAULT_STORE_URL}[where]
    run = run_main(argv)
    assert run.code == 2 and f"store {expected}: no such SQLite file" in run.stderr
    assert not list(tmp_path.glob("*.db"))


@pytest.mark.parametrize(
    "command",
    [["plan"], ["run"], ["fit"], ["profile"], ["profile", "links"], ["dashboard"]],
    ids=" ".join,
)
def test_help_names_the_environment_variable(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    assert f"${STORE_URL_ENV}" in capsys.readouterr().out.replace("\n", " ")


def test_the_runtime_entry_point_reads_the_environment(monkeypatch):
    from hexiseq.runtime.train import parse_args

    monkeypatch.setenv(STORE_URL_ENV, UNREACHABLE)
    assert parse_args(["--plan", "p.json"]).store_url == UNREACHABLE
    assert parse_args(["--plan", "p.json", "--store", "sqlite://"]).store_url == "sqlite://"
    assert parse_args(["--plan", "p.json", "--no-store"]).store_url is None


def test_the_link_sweep_entry_point_reads_the_environment(monkeypatch):
    from hexiseq.profiler.links import parse_args

    monkeypatch.setenv(STORE_URL_ENV, UNREACHABLE)
    assert parse_args(["--grid", "g.yaml"]).store == UNREACHABLE


# --- no password in any message -----------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        f"postgresql://u:{SECRET}@127.0.0.1:1/db",
        f"postgresql+psycopg://u:{SECRET}/x@host/db",  # a "/" in the password
        f"postgresql://u:p@{SECRET}@host/db",  # an unencoded "@" in the password
        f"postgres ql://u:{SECRET}@host/db",  # cannot be parsed
        f"u:{SECRET}@host/db",  # no scheme
        f"store `postgresql://:{SECRET}@host/db` cannot be opened",
        f"postgresql://u@host/db?sslmode=require&password={SECRET}",
    ],
)
def test_mask_url_passwords_hides_the_password(text):
    masked = mask_url_passwords(text)
    assert SECRET not in masked and "***" in masked


def test_mask_url_passwords_leaves_urls_without_password_alone():
    for text in ("sqlite:///hexiseq.db", "postgresql://u@host:5432/db", "device cuda:0 failed"):
        assert mask_url_passwords(text) == text


@pytest.mark.parametrize("env", [False, True], ids=["--store", "environment"])
def test_plan_with_an_unreachable_store_fails_in_one_line_without_the_password(env, monkeypatch):
    if env:
        monkeypatch.setenv(STORE_URL_ENV, UNREACHABLE)
    run = run_main(PLAN_ARGS if env else [*PLAN_ARGS, "--store", UNREACHABLE])
    assert_one_secret_free_line(run)
    assert "postgresql://u:***@127.0.0.1:1/db" in run.stderr


@pytest.mark.parametrize(
    "url",
    [
        f"postgres ql://u:{SECRET}@host/db",
        f"u:{SECRET}@host/db",
        f"mysql://u:{SECRET}@host/db",
        f"sqlite://u:{SECRET}@//tmp/x.db",  # SQLAlchemy's own error repeats the URL
    ],
)
@pytest.mark.parametrize("command", [PLAN_ARGS, ["fit"], ["profile", "--quick"]], ids=str)
def test_a_bad_store_url_is_one_line_without_the_password(url, command):
    assert_one_secret_free_line(run_main([*command, "--store", url]))


@pytest.mark.parametrize("url", [f"postgres ql://u:{SECRET}@host/db", f"u:{SECRET}@host/db"])
def test_an_unparseable_optuna_storage_is_one_line_without_the_password(url):
    assert_one_secret_free_line(run_main([*PLAN_ARGS, "--no-store", "--storage", url]))
    with pytest.raises(InputError, match=r"storage URL .* cannot be parsed") as raised:
        plan_search("cpu-emulated-2type", "tiny", 8192, storage=url)
    assert SECRET not in str(raised.value)


@pytest.mark.parametrize(
    "url", [f"sqlite://u:{SECRET}@//tmp/x.db", f"nosuchdialect://u:{SECRET}@host/db"]
)
def test_an_unusable_optuna_storage_is_one_line_without_the_password(url):
    """SQLAlchemy parses these but refuses them with a message that repeats the URL."""
    run = run_main([*PLAN_ARGS, "--no-store", "--trials", "1", "--storage", url])
    assert_one_secret_free_line(run)
    assert "storage URL" in run.stderr


def test_store_repr_and_url_mask_the_password_given_as_query_parameter(tmp_path):
    with pytest.warns(Warning, match="password"):  # pysqlite ignores it, and says so
        store = Store.open(f"sqlite:///{tmp_path / 'q.db'}?password={SECRET}")
    with store:
        assert SECRET not in store.url and SECRET not in repr(store)


# --- children: the URL in the environment, never argv --------------------------------------


@pytest.fixture()
def started(monkeypatch) -> list[tuple[list[str], dict[str, str]]]:
    """Every subprocess.run of the CLI: (command, environment), nothing really started."""
    calls = []

    def fake_run(command, *, env=None, check=False):
        calls.append((command, env))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    return calls


def assert_url_in_environment_only(command: list[str], env: dict[str, str], url: str) -> None:
    assert env is not None and env[STORE_URL_ENV] == url
    assert not any(word in argument for argument in command for word in (url, SECRET, "--store"))


@pytest.mark.parametrize("env", [False, True], ids=["--store", "environment"])
def test_run_hands_the_store_to_torchrun_in_the_environment(env, started, monkeypatch):
    if env:
        monkeypatch.setenv(STORE_URL_ENV, UNREACHABLE)
    argv = ["run", "--plan", V1_PLAN, "--steps", "2"]
    assert main(argv if env else [*argv, "--store", UNREACHABLE]) == 0
    ((command, environment),) = started
    assert command[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert_url_in_environment_only(command, environment, UNREACHABLE)


def test_run_without_store_passes_no_store(started):
    assert main(["run", "--plan", V1_PLAN, "--no-store"]) == 0
    ((command, _),) = started
    assert "--no-store" in command


def test_profile_links_hands_the_store_to_its_ranks_in_the_environment(started, tmp_path):
    url = f"sqlite:///{tmp_path / 'links.db'}"
    assert main(["profile", "links", "--nproc", "2", "--quick", "--store", url]) == 0
    ((command, environment),) = started
    assert command[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "hexiseq.profiler.links" in command
    assert_url_in_environment_only(command, environment, url)
    assert environment["OMP_NUM_THREADS"]
    assert _cli_profile.links_command  # the builder the test went through


def test_dashboard_hands_both_urls_to_streamlit_in_the_environment(started, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    optuna_url = f"postgresql://u:{SECRET}@db.example/optuna"
    assert main(["dashboard", "--store", url, "--optuna-storage", optuna_url]) == 0
    ((command, environment),) = started
    assert command[1:4] == ["-m", "streamlit", "run"]
    assert_url_in_environment_only(command, environment, url)
    assert environment[OPTUNA_STORAGE_ENV] == optuna_url
    assert not any("optuna" in argument for argument in command)
    out = capsys.readouterr().out
    assert "postgresql://u:***@db.example/optuna" in out and SECRET not in out


def test_dashboard_without_optuna_storage_drops_a_stale_one(started, tmp_path, monkeypatch):
    monkeypatch.setenv(OPTUNA_STORAGE_ENV, "sqlite:///stale.db")
    assert main(["dashboard", "--store", f"sqlite:///{tmp_path / 'x.db'}"]) == 0
    ((_, environment),) = started
    assert OPTUNA_STORAGE_ENV not in environment


def test_dashboard_refuses_an_unparseable_optuna_storage_before_starting(started, tmp_path):
    argv = ["dashboard", "--store", f"sqlite:///{tmp_path / 'x.db'}"]
    run = run_main([*argv, "--optuna-storage", f"postgres ql://u:{SECRET}@h/db"])
    assert_one_secret_free_line(run)
    assert "--optuna-storage" in run.stderr and not started


# --- the dashboard: masked everywhere, only the operator's databases ----------------------


def page_text(app) -> str:
    """Everything the page's elements carry (text, labels, options), as one string."""
    parts = []

    def walk(node) -> None:
        if getattr(node, "proto", None) is not None:
            parts.append(str(node.proto))
        for child in getattr(node, "children", {}).values():
            walk(child)

    walk(app._tree)
    return "\n".join(parts)


def open_page(page: str, store_url: str, optuna_storage: str | None = None):
    from streamlit.testing.v1 import AppTest

    from hexiseq.dashboard import _session

    app = AppTest.from_file(str(APP), default_timeout=60)
    app.session_state[_session.STORE_URL_KEY] = store_url
    app.session_state[_session.OPTUNA_STORAGE_KEY] = optuna_storage
    app.run()
    app.switch_page(f"screens/{page}.py").run()
    assert not app.exception, [e.value for e in app.exception]
    return app


@pytest.mark.parametrize("page", ["plan", "throughput"])
def test_dashboard_pages_never_show_the_password_of_a_store_they_cannot_open(page):
    pytest.importorskip("streamlit")
    app = open_page(page, UNREACHABLE, optuna_storage=UNREACHABLE.replace("u:", "v:"))
    shown = page_text(app)
    assert SECRET not in shown
    assert "postgresql://u:***@127.0.0.1:1/db" in shown  # the sidebar says which store
    assert len(app.error) == 1


@pytest.fixture()
def sqlite_behind_a_password_url(monkeypatch, tmp_path):
    """The dashboard's store at a PostgreSQL URL with a password, served by a SQLite file."""
    pytest.importorskip("streamlit")
    from hexiseq.dashboard import _session

    path = tmp_path / "store.db"
    monkeypatch.setattr(_session, "_open_store", lambda url: Store.open(f"sqlite:///{path}"))
    return path


def test_throughput_page_offers_only_the_configured_storages_masked(
    sqlite_behind_a_password_url, tmp_path
):
    import optuna

    study_url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(storage=study_url, study_name="kept", direction="maximize")
    study.optimize(lambda trial: trial.suggest_float("x", 0.0, 1.0), n_trials=3)
    app = open_page("throughput", f"postgresql://u:{SECRET}@db.example/hexiseq", study_url)
    assert not app.text_input, "a visitor must not type a URL"
    choice = app.selectbox(key="optuna_storage")
    assert choice.options == [
        "the store: postgresql://u:***@db.example/hexiseq",
        f"--optuna-storage: {study_url}",
    ]
    assert SECRET not in page_text(app)  # the store's Optuna read fails: masked, one line
    choice.select_index(1).run()
    assert not app.exception, [e.value for e in app.exception]
    assert app.selectbox(key="optuna_study").options == ["kept"]
    assert SECRET not in page_text(app)


def test_throughput_page_without_optuna_storage_offers_the_store_alone(
    sqlite_behind_a_password_url, tmp_path
):
    app = open_page("throughput", f"sqlite:///{sqlite_behind_a_password_url}")
    assert app.selectbox(key="optuna_storage").options == [
        f"the store: sqlite:///{sqlite_behind_a_password_url}"
    ]
    assert list(tmp_path.iterdir()) == [sqlite_behind_a_password_url]  # nothing else created


def test_the_app_takes_its_store_from_the_environment_not_argv(monkeypatch, tmp_path):
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    url = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv(STORE_URL_ENV, url)
    monkeypatch.setattr(sys, "argv", ["app.py", "--store", "sqlite:///argv.db"])
    app = AppTest.from_file(str(APP), default_timeout=60).run()
    assert not app.exception, [e.value for e in app.exception]
    assert f"store: `{url}`" in [caption.value for caption in app.sidebar.caption]
