"""Bad inputs at every entry point, and what each one gets (issue 17's fuzz set).

    .venv/bin/python benchmarks/bad_inputs.py [--timeout-s 30] [--no-results]

Every case is an input hexiseq must refuse: a CLI command line (run in process through
`hexiseq.cli.main`, as the `hexiseq` script runs it), a Python API call, or a file (cluster
YAML, model config, plan JSON, profile grid) given to either. Each case ends as one of:

- clear: the CLI exits 2 with one line on stderr (3 where the case is a well-formed request no
  plan can satisfy), the API raises `hexiseq.HexiseqError` with a one-line message; and nothing
  is written: the case's `--out` file and store are not created (or not changed);
- traceback: any other exception, any other exit code, or a message of several lines;
- hang: no answer within the time limit (SIGALRM);
- accepted: exit 0 or no exception — the input was taken as if it were valid;
- wrote: the answer was clear but a file the case watches was created or changed.

The cases run in one process, one after another (a few that must start processes, e.g.
`hexiseq run`, stop at their checks before). Prints the counts per entry point and writes them
with every case that was not clear into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import signal
import sqlite3
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import replace_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OUTCOMES = ("clear", "traceback", "hang", "accepted", "wrote")


@dataclass
class Case:
    entry: str
    label: str
    argv: list[str] | None = None
    call: Callable[[], object] | None = None
    watched: list[Path] = field(default_factory=list)
    infeasible_ok: bool = False


# --- the cases --------------------------------------------------------------------------------


def _write(directory: Path, name: str, content: str | bytes) -> str:
    path = directory / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


GOOD_CLUSTER = """name: two
nodes:
  - {name: a, gpu: H100-SXM, count: 4}
  - {name: b, gpu: A100-80G, count: 4}
network: {inter_node_GBps: 50}
"""


def cluster_files(d: Path) -> dict[str, str]:
    """Cluster YAML files, each wrong in one way."""
    node = "  - {name: a, gpu: H100-SXM, count: %s}\n"
    net = "network: {inter_node_GBps: %s}\n"
    base = "name: c\nnodes:\n"
    texts: dict[str, str | bytes] = {
        "not UTF-8": b"name: c\nnodes:\n  - {name: \xff\xfe, gpu: H100-SXM, count: 8}\n",
        "not YAML": "name: [c\nnodes: {",
        "self-referencing alias": "a: &x [*x]\n",
        "a list": "- 1\n- 2\n",
        "empty": "",
        "a scalar": "42\n",
        "no nodes": "name: c\nnetwork: {inter_node_GBps: 50}\n",
        "empty nodes": "name: c\nnodes: []\n",
        "unknown key": base + node % 8 + "colour: red\n",
        "unknown GPU": "name: c\nnodes:\n  - {name: a, gpu: H900, count: 8}\n",
        "count 0": base + node % 0,
        "count -1": base + node % -1,
        "count 2.5": base + node % 2.5,
        "count '8'": base + node % "'8'",
        "count 1e9": base + node % 1000000000,
        "count true": base + node % "true",
        "200,000 GPUs": base + node % 200000,
        "bandwidth 0": base + node % 8 + net % 0,
        "bandwidth -1": base + node % 8 + net % -1,
        "bandwidth 1e-300": base + node % 8 + net % 1e-300,
        "bandwidth .inf": base + node % 8 + net % ".inf",
        "bandwidth .nan": base + node % 8 + net % ".nan",
        "bandwidth 'fast'": base + node % 8 + net % "fast",
        "latency -1": base
        + node % 8
        + "network: {inter_node_GBps: 50, inter_node_latency_us: -1}\n",
        "latency 1e12": base
        + node % 8
        + "network: {inter_node_GBps: 50, inter_node_latency_us: 1.0e+12}\n",
        "override of an unknown node": base
        + node % 8
        + "network: {inter_node_GBps: 50, overrides: [{a: a, b: zz, GBps: 5}]}\n",
        "duplicate node names": base + node % 4 + node % 4,
        "intra-node bandwidth -5": "name: c\nnodes:\n"
        "  - {name: a, gpu: H100-SXM, count: 8, intra_node_GBps: -5}\n",
        "emulation slowdown 0": "name: c\nnodes:\n"
        "  - {name: a, gpu: cpu, count: 2, emulation_slowdown: 0}\n",
        "emulation slowdown on a GPU": "name: c\nnodes:\n"
        "  - {name: a, gpu: H100-SXM, count: 2, emulation_slowdown: 2}\n",
        "memory_GiB -1": "name: c\nnodes:\n  - {name: a, gpu: cpu, count: 2, memory_GiB: -1}\n",
        "name 123": "name: 123\nnodes:\n  - {name: a, gpu: H100-SXM, count: 8}\n",
        "gpu a list": "name: c\nnodes:\n  - {name: a, gpu: [H100-SXM], count: 8}\n",
        "deeply nested": "a: " + "[" * 5000 + "]" * 5000 + "\n",
    }
    return {
        label: _write(d, f"cluster-{i}.yaml", text)
        for i, (label, text) in enumerate(texts.items())
    }


def model_files(d: Path) -> dict[str, str]:
    good = {
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "vocab_size": 32000,
    }
    variants = {
        "gpt2 config": {**good, "model_type": "gpt2"},
        "layers 2.5": {**good, "num_hidden_layers": 2.5},
        "hidden 1e300": {**good, "hidden_size": 1e300},
        "heads 0": {**good, "num_attention_heads": 0},
        "kv heads 3 of 8": {**good, "num_key_value_heads": 3},
        "gelu": {**good, "hidden_act": "gelu"},
    }
    files = {
        label: _write(d, f"model-{i}.json", json.dumps(doc))
        for i, (label, doc) in enumerate(variants.items())
    }
    files["config not JSON"] = _write(d, "model-x.json", "{nope")
    files["YAML layers 2.5"] = _write(d, "model-y.yaml", "layers: 2.5\n")
    files["YAML tied 'no'"] = _write(
        d,
        "model-z.yaml",
        "layers: 2\nhidden: 64\nheads: 4\nkv_heads: 4\nhead_dim: 16\nffn_hidden: 128\n"
        "vocab: 100\ntied_embeddings: 'no'\n",
    )
    return files


def plan_files(d: Path, good_plan: dict) -> dict[str, str]:
    """Plan JSON files, each wrong in one way (from a good plan of cpu-emulated-2type)."""

    def edited(change: Callable[[dict], None]) -> str:
        document = json.loads(json.dumps(good_plan))
        change(document)
        return json.dumps(document)

    def set_path(*path_and_value):
        *path, value = path_and_value

        def change(document):
            target = document
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value

        return change

    def fractions(document, values):
        for assignment, value in zip(document["assignments"], values):
            assignment["state_fraction"] = value

    text = json.dumps(good_plan)
    texts: dict[str, str | bytes] = {
        "truncated": text[: len(text) // 2],
        "not UTF-8": b"\xff\xfe" + text.encode(),
        "not JSON": "plan",
        "a list": "[1, 2]",
        "empty": "",
        "schema_version 99": edited(set_path("schema_version", 99)),
        "schema_version '2'": edited(set_path("schema_version", "2")),
        "no assignments": edited(lambda doc: doc.pop("assignments")),
        "unknown field": edited(set_path("colour", "red")),
        "state fractions summing to 20": edited(lambda doc: fractions(doc, [5, 5, 5, 5])),
        "a negative state fraction": edited(lambda doc: fractions(doc, [1.5, -0.5, 0, 0])),
        "NaN step time": text.replace(
            f'"step_time_s": {json.dumps(good_plan["predicted"]["step_time_s"])}',
            '"step_time_s": NaN',
        ),
        "negative tokens/s": edited(set_path("predicted", "tokens_per_s", -5.0)),
        "seq_len 3": edited(set_path("train", "seq_len", 3)),
        "micro_batches 0": edited(set_path("train", "micro_batches", 0)),
        "unknown runtime recipe": edited(set_path("train", "runtime_recipe", "magic")),
        "model layers 2.5": edited(set_path("model", "layers", 2.5)),
        "model hidden 1e300": edited(set_path("model", "hidden", 1e300)),
        "tokens that disagree with the layout": edited(
            lambda doc: doc["assignments"][0].update(tokens=doc["assignments"][0]["tokens"] + 2)
        ),
        "a GPU type the node does not have": edited(
            lambda doc: doc["assignments"][0].update(gpu="H100-SXM")
        ),
        "cluster of an unknown GPU": edited(
            lambda doc: doc["cluster"]["nodes"][0].update(gpu="X")
        ),
        "activation_checkpointing 'no'": edited(
            set_path("train", "activation_checkpointing", "no")
        ),
    }
    return {
        label: _write(d, f"plan-{i}.json", content)
        for i, (label, content) in enumerate(texts.items())
    }


def grid_files(d: Path) -> dict[str, str]:
    texts = {
        "not YAML": "timing: {",
        "unknown op": "name: g\nconvolution: {sizes: [1]}\n",
        "samples 1": "name: g\ntiming: {warmup_s: 0.01, samples: 1, input_sets: 1}\n",
        "negative ladder": "name: g\ngemm: {models: [tiny], tokens: [256], ladder: [-128]}\n",
        "a list": "- 1\n",
        "not UTF-8": b"name: \xff\n",
    }
    return {label: _write(d, f"grid-{i}.yaml", t) for i, (label, t) in enumerate(texts.items())}


def foreign_sqlite(d: Path) -> str:
    path = d / "foreign.db"
    with sqlite3.connect(path) as connection:
        connection.execute("CREATE TABLE IF NOT EXISTS plans (x INTEGER)")
        connection.execute("INSERT INTO plans VALUES (1)")
    return f"sqlite:///{path}"


def two_revision_store(d: Path) -> str:
    """A hexiseq store whose version table holds two revisions (hexiseq writes one)."""
    from hexiseq import migrations
    from hexiseq.store import Store

    path = d / "two-revisions.db"
    if not path.exists():  # each entry point's cases ask for the URLs again
        Store.open(f"sqlite:///{path}").close()
        with sqlite3.connect(path) as connection:
            connection.execute(f"INSERT INTO {migrations.VERSION_TABLE} VALUES ('0003')")
    return f"sqlite:///{path}"


def bad_urls(d: Path) -> dict[str, str]:
    (d / "a-directory").mkdir(exist_ok=True)
    _write(d, "not-a-database.db", "hello, not SQLite")
    return {
        "unsupported dialect": "mysql://u@localhost/db",
        "missing driver": "postgresql+pg8000://u@127.0.0.1/db",
        "unreachable host": "postgresql+psycopg://u:secret@127.0.0.1:1/db",
        "not a URL": "::::",
        "http URL": "http://example.com/db",
        "a directory": f"sqlite:///{d / 'a-directory'}",
        "not a database": f"sqlite:///{d / 'not-a-database.db'}",
        "foreign SQLite": foreign_sqlite(d),
        "two schema revisions": two_revision_store(d),
        "under /proc": "sqlite:////proc/hexiseq/x.db",
        "empty": "",
    }


def old_optuna_storage(d: Path) -> str:
    """An Optuna storage whose tables an older Optuna made (its schema version set back)."""
    import optuna

    url = f"sqlite:///{d / 'old-optuna.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(storage=url, study_name="theirs")
    with sqlite3.connect(d / "old-optuna.db") as connection:
        connection.execute("UPDATE alembic_version SET version_num = 'v3.0.0.d'")
    return url


def cli_cases(d: Path, good_plan_path: str, good_plan: dict) -> list[Case]:
    cluster = _write(d, "good-cluster.yaml", GOOD_CLUSTER)
    out = d / "out.json"
    store = d / "fresh.db"
    plan = ["plan", "--cluster", cluster, "--model", "tiny", "--no-store"]
    plan_sl = [*plan, "--seq-len"]
    watched = [out, store, d / "hexiseq.db"]  # d is the working directory: the default store
    cases: list[Case] = []

    def add(entry, label, argv, infeasible_ok=False):
        cases.append(Case(entry, label, argv=argv, watched=watched, infeasible_ok=infeasible_ok))

    seq_lens = ["3", "131073", "100000000000000000000", "-1", "0", "abc", "1e3k", "1.5k",
                "inf", "nan", " ", "", "1M1", "0x10", "2", "999999999999999", "128kk",
                "-128k"]  # fmt: skip
    for value in seq_lens:
        add("plan --seq-len", value or "(empty)", [*plan_sl, value, "--out", str(out)])
    for value in ["-1", "4294967296", "abc", "1.5", ""]:
        add("plan --seed", value or "(empty)", [*plan_sl, "8k", "--seed", value])
    for option in ("--trials", "--workers", "--time-budget", "--micro-batches"):
        for value in ["0", "-1", "inf", "nan", "2.5", "abc", "1e400"]:
            if option == "--time-budget" and value == "2.5":
                value = "0.0"  # 2.5 s is a good budget
            add(f"plan {option}", value, [*plan_sl, "8k", option, value])
    add("plan --workers", "10**6", [*plan_sl, "8k", "--workers", "1000000"])
    add("plan --micro-batches", "10**9", [*plan_sl, "8k", "--micro-batches", "1000000000"])
    for option, value in [("--cost-model", "magic"), ("--checkpointing", "no"),
                          ("--precision", "fp16"), ("--cost-model", "fitted")]:  # fmt: skip
        add(f"plan {option}", value, [*plan_sl, "8k", option, value])
    add("plan --study-name", "without --storage", [*plan_sl, "8k", "--study-name", "s"])
    add("plan --out", "a directory", [*plan_sl, "8k", "--out", str(d)])
    add("plan --out", "under a file", [*plan_sl, "8k", "--out", f"{good_plan_path}/x.json"])
    add("plan --out", "- with --json", [*plan_sl, "8k", "--out", "-", "--json"])
    for label, path in cluster_files(d).items():
        add("plan --cluster (YAML)", label, ["plan", "--cluster", path, "--model", "tiny",
                                              "--seq-len", "8k", "--out", str(out),
                                              "--store", f"sqlite:///{store}"])  # fmt: skip
    add("plan --cluster", "a missing file", ["plan", "--cluster", str(d / "none.yaml"),
                                             "--model", "tiny", "--seq-len", "8k"])  # fmt: skip
    for label, path in model_files(d).items():
        add("plan --model (file)", label, [*plan, "--model", path, "--seq-len", "8k"])
    add("plan --model", "unknown preset", [*plan, "--model", "gpt5", "--seq-len", "8k"])
    add("plan --model", "hub name not cached", [*plan, "--model", "org/none", "--seq-len", "8k"])
    add("plan", "70B on one small cluster at 1M", ["plan", "--cluster", "cpu-emulated-2type",
        "--model", "llama3-70b", "--seq-len", "1M", "--no-store"], infeasible_ok=True)  # fmt: skip
    for label, url in bad_urls(d).items():
        add(
            "--store URL (plan)",
            label,
            [*plan_sl, "8k"][:-1] + ["--store", url, "--seq-len", "8k"],
        )
        # Optuna shares a database with other tables by design, and keeps its own revision
        if label not in ("foreign SQLite", "two schema revisions"):
            add("--storage URL (plan)", label, [*plan_sl, "8k", "--trials", "2", "--storage", url])
        add("--store URL (fit)", label, ["fit", "--store", url])
        add("--store URL (plans list)", label, ["plans", "list", "--store", url])
    add("--storage URL (plan)", "Optuna tables of an older schema",
        [*plan_sl, "8k", "--trials", "2", "--storage", old_optuna_storage(d)])  # fmt: skip
    for label, path in plan_files(d, good_plan).items():
        add("predict --plan", label, ["predict", "--plan", path])
        add("run --plan", label, ["run", "--plan", path, "--no-store", "--device", "cpu"])
    add("run", "--steps 0", ["run", "--plan", good_plan_path, "--steps", "0", "--no-store"])
    add("run", "--steps -1", ["run", "--plan", good_plan_path, "--steps", "-1", "--no-store"])
    add("run", "--device cuda (none here)", ["run", "--plan", good_plan_path, "--device", "cuda"])
    add("run", "--device tpu", ["run", "--plan", good_plan_path, "--device", "tpu"])
    add("run", "--seed -1", ["run", "--plan", good_plan_path, "--seed", "-1", "--no-store"])
    add("run", "a missing plan", ["run", "--plan", str(d / "none.json")])
    node_run = ["run", "--plan", good_plan_path, "--no-store", "--device", "cpu"]
    for label, flags in {
        "--node-rank past the plan's nodes": ["--node-rank", "9"],
        "--node-rank -1": ["--node-rank", "-1"],
        "--node-rank 1.5": ["--node-rank", "1.5"],
        "--master without a port": ["--node-rank", "0", "--master", "10.0.0.1"],
        "--master port 0": ["--node-rank", "0", "--master", "10.0.0.1:0"],
        "--master port 65536": ["--node-rank", "0", "--master", "10.0.0.1:65536"],
        "--master without a host": ["--node-rank", "0", "--master", ":29500"],
    }.items():
        add("run --node-rank/--master", label, [*node_run, *flags])
    empty_store = f"sqlite:///{d / 'empty-store.db'}"
    for label, argv in {
        "--device tpu": ["--device", "tpu"],
        "--device cuda (none here)": ["--device", "cuda"],
        "--emulation-slowdown 0": ["--emulation-slowdown", "0"],
        "--emulation-slowdown nan": ["--emulation-slowdown", "nan"],
        "--emulation-slowdown on cuda": ["--device", "cuda", "--emulation-slowdown", "2"],
        "--threads 0": ["--threads", "0"],
        "--threads abc": ["--threads", "abc"],
        "--grid missing": ["--grid", str(d / "none.yaml")],
    }.items():
        add("profile", label, ["profile", *argv, "--store", empty_store])
    for label, path in grid_files(d).items():
        add("profile --grid", label, ["profile", "--grid", path, "--store", empty_store])
    for label, argv in {
        "links --nproc 0": ["profile", "links", "--nproc", "0"],
        "links --device tpu": ["profile", "links", "--device", "tpu"],
    }.items():
        add("profile links", label, [*argv, "--store", empty_store])
    add("fit", "a store with no profile", ["fit", "--store", empty_store])
    for value in ["-1", "abc", "999", "1.5", ""]:
        add("plans show", value or "(empty)", ["plans", "show", value, "--store", empty_store])
        add("plans export", value or "(empty)", ["plans", "export", value, "--store", empty_store])
    add("plans list", "--limit 0", ["plans", "list", "--limit", "0", "--store", empty_store])
    for value in ["0", "-1", "99999", "abc"]:
        add("dashboard --port", value, ["dashboard", "--port", value, "--store", empty_store])
    add("dashboard", "--store unreachable", ["dashboard", "--store",
        "postgresql+psycopg://u:pw@127.0.0.1:1/db", "--port", "8599"])  # fmt: skip
    add("(no command)", "unknown command", ["optimise"])
    return cases


def api_cases(d: Path, good_plan_path: str) -> list[Case]:
    import hexiseq
    from hexiseq import Cluster, ModelSpec, Plan, plan_search
    from hexiseq.layout import build_zigzag_layout
    from hexiseq.model_files import load_model
    from hexiseq.search.options import search_options
    from hexiseq.store import Store

    good = {"cluster": "cpu-emulated-2type", "model": "tiny", "seq_len": 512}
    cases: list[Case] = []

    def add(entry, label, call):
        cases.append(Case(entry, label, call=call))

    search_bad = {
        "cluster=123": {"cluster": 123},
        "cluster=None": {"cluster": None},
        "cluster='nope'": {"cluster": "nope"},
        "model=123": {"model": 123},
        "model='gpt5'": {"model": "gpt5"},
        "seq_len='abc'": {"seq_len": "abc"},
        "seq_len=3": {"seq_len": 3},
        "seq_len=-512": {"seq_len": -512},
        "seq_len=2.5": {"seq_len": 2.5},
        "seq_len=10**20": {"seq_len": 10**20},
        "seed='abc'": {"seed": "abc"},
        "seed=-1": {"seed": -1},
        "seed=2**32": {"seed": 2**32},
        "time_budget_s='10'": {"time_budget_s": "10"},
        "time_budget_s=nan": {"time_budget_s": float("nan")},
        "time_budget_s=inf": {"time_budget_s": float("inf")},
        "time_budget_s=-1": {"time_budget_s": -1.0},
        "workers='2'": {"workers": "2"},
        "workers=0": {"workers": 0},
        "n_trials=2.5": {"n_trials": 2.5},
        "n_trials=0": {"n_trials": 0},
        "activation_checkpointing='no'": {"activation_checkpointing": "no"},
        "storage=123": {"storage": 123},
        "storage='mysql://x'": {"storage": "mysql://u@h/db", "n_trials": 2},
        "cost_model='fitted'": {"cost_model": "fitted"},
        "multi_objective='yes'": {"multi_objective": "yes"},
        "micro_batches=0": {"micro_batches": 0},
        "precision='fp16'": {"precision": "fp16"},
        "study_name=''": {"study_name": ""},
        "options= and keywords": {"options": None, "seed": 3},
    }
    for label, change in search_bad.items():
        arguments = {**good, **change}
        if "options" in arguments:
            arguments["options"] = search_options()

        def call(arguments=arguments):
            positional = [arguments.pop(k) for k in ("cluster", "model", "seq_len")]
            return plan_search(*positional, **arguments)

        add("plan_search", label, call)
    for label, keywords in {"unknown option": {"colour": 1}, "seed=True": {"seed": True}}.items():
        add("search_options", label, lambda keywords=keywords: search_options(**keywords))
    for label, document in {
        "a list": [1],
        "nodes=None": {"name": "c", "nodes": None},
        "count='8'": {"name": "c", "nodes": [{"name": "a", "gpu": "H100-SXM", "count": "8"}]},
        "count=True": {"name": "c", "nodes": [{"name": "a", "gpu": "H100-SXM", "count": True}]},
        "GBps=nan": {
            "name": "c",
            "nodes": [{"name": "a", "gpu": "H100-SXM", "count": 2}],
            "network": {"inter_node_GBps": float("nan")},
        },  # fmt: skip
    }.items():
        add("Cluster.from_dict", label, lambda document=document: Cluster.from_dict(document))
    add("Cluster.preset", "unknown", lambda: Cluster.preset("nope"))
    add("Cluster.from_yaml", "a missing file", lambda: Cluster.from_yaml(d / "none.yaml"))
    shape = dict(name="m", layers=2, hidden=64, heads=4, kv_heads=4, head_dim=16,
                 ffn_hidden=128, vocab=100)  # fmt: skip
    for label, change in {
        "layers=2.5": {"layers": 2.5},
        "hidden=1e300": {"hidden": 1e300},
        "heads=0": {"heads": 0},
        "kv_heads=3": {"kv_heads": 3},
        "vocab='100'": {"vocab": "100"},
        "rope_theta=nan": {"rope_theta": float("nan")},
        "tied_embeddings='no'": {"tied_embeddings": "no"},
        "name=123": {"name": 123},
    }.items():
        add("ModelSpec", label, lambda change=change: ModelSpec(**{**shape, **change}))
    add("ModelSpec.preset", "unknown", lambda: ModelSpec.preset("gpt5"))
    for label, path in model_files(d).items():
        add("load_model", label, lambda path=path: load_model(path))
    add("load_model", "123", lambda: load_model(123))
    for label, path in plan_files(d, json.loads(Path(good_plan_path).read_text())).items():
        add("Plan.from_json", label, lambda path=path: Plan.from_json(path))
    add("Plan.from_json", "a missing file", lambda: Plan.from_json(d / "none.json"))
    for label, url in bad_urls(d).items():
        add("Store.open", label, lambda url=url: Store.open(url).close())
    add("Store.open", "123", lambda: Store.open(123))
    for label, arguments in {
        "segments not summing": (16, 8, 2, [[0]], [10], [[1]], [[8]]),
        "heads not summing": (16, 8, 2, [[0, 1]], [16], [[1, 1]], [[4, 3]]),
        "rank twice": (16, 8, 2, [[0, 0]], [16], [[1, 1]], [[4, 4]]),
        "odd segment": (15, 8, 2, [[0]], [15], [[1]], [[8]]),
        "negative weight": (16, 8, 2, [[0, 1]], [16], [[1, -1]], [[4, 4]]),
        "kv heads not dividing": (16, 8, 3, [[0]], [16], [[1]], [[8]]),
    }.items():
        add("build_zigzag_layout", label, lambda a=arguments: build_zigzag_layout(*a))
    for value in ["3", "abc", "100000000000000000000", "", "-1k", "inf", "1M1"]:
        add("dashboard what-if form", f"seq len {value or '(empty)'}",
            lambda value=value: whatif_form(d, value))  # fmt: skip
    add("predict", "plan=123", lambda: hexiseq.predict(123))
    add("predict", "cost_model='magic'", lambda: hexiseq.predict(Plan.from_json(good_plan_path),
                                                                cost_model="magic"))  # fmt: skip
    return cases


def whatif_form(d: Path, seq_len: str) -> None:
    """Submit the dashboard's what-if form (Streamlit's AppTest) with a sequence length: a
    clear refusal is one error on the page, no exception and no Save button (raised here as
    an InputError carrying the page's message, so the judge counts it as clear)."""
    from streamlit.testing.v1 import AppTest

    from hexiseq.dashboard import _session
    from hexiseq.errors import InputError

    app = AppTest.from_file(str(REPO / "dashboard" / "app.py"), default_timeout=60)
    app.session_state[_session.STORE_URL_KEY] = f"sqlite:///{d / 'dashboard.db'}"
    app.run()
    app.switch_page("screens/whatif.py").run()
    app.selectbox(key="whatif_cluster").set_value("cpu-emulated-2type")
    app.selectbox(key="whatif_model").set_value("tiny")
    app.text_input(key="whatif_seq_len").set_value(seq_len)
    app.button[0].click().run()
    if app.exception:
        raise RuntimeError(f"the page raised: {app.exception[0].value}")
    errors = [str(e.value) for e in app.error]
    saving = any(b.key == "whatif_save" for b in app.button)
    if len(errors) == 1 and "\n" not in errors[0].strip() and not saving:
        raise InputError(errors[0])
    if errors:
        raise RuntimeError(f"{len(errors)} errors, save button {saving}: {errors[:2]}")


# --- running and judging -----------------------------------------------------------------------


class _HangError(Exception):
    pass


def _alarm(_signum, _frame):
    raise _HangError


def _fingerprint(paths: list[Path]) -> dict[str, str | None]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None for p in paths
    }


def judge(case: Case, timeout_s: float) -> tuple[str, str]:
    """(outcome, what happened in one line) of one case."""
    before = _fingerprint(case.watched)
    out, err = io.StringIO(), io.StringIO()
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            outcome, detail = _run(case)
    except _HangError:
        outcome, detail = "hang", f"no answer in {timeout_s:g} s"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if outcome == "cli":
        outcome, detail = _judge_cli(case, detail, err.getvalue())
    if outcome == "clear" and _fingerprint(case.watched) != before:
        changed = [p for p, h in _fingerprint(case.watched).items() if h != before[p]]
        outcome, detail = "wrote", f"{detail} — but wrote {', '.join(changed)}"
    return outcome, detail


def _run(case: Case) -> tuple[str, str]:
    from hexiseq.errors import HexiseqError

    if case.argv is not None:
        from hexiseq.cli import main

        try:
            code = main(case.argv)
        except SystemExit as exit_:
            code = exit_.code
        except _HangError:
            raise
        except BaseException as error:  # noqa: BLE001 - what the user would see
            return "traceback", _last_frame(error)
        return "cli", str(code)
    try:
        case.call()
    except _HangError:
        raise
    except HexiseqError as error:
        message = str(error)
        if "\n" in message.strip() or not message.strip():
            return "traceback", f"{type(error).__name__} of several lines: {message[:120]!r}"
        return "clear", message[:160]
    except BaseException as error:  # noqa: BLE001
        return "traceback", _last_frame(error)
    return "accepted", "no error raised"


def _judge_cli(case: Case, code: str, stderr: str) -> tuple[str, str]:
    lines = [line for line in stderr.splitlines() if line.strip()]
    if "Traceback" in stderr:
        return "traceback", f"exit {code}: {lines[-1][:160] if lines else ''}"
    if code in ("2", "3") and len(lines) == 1 and (code == "2" or case.infeasible_ok):
        return "clear", f"exit {code}: {lines[0][:160]}"
    if code in ("0", "None"):
        return "accepted", f"exit 0: {(lines or ['(nothing on stderr)'])[0][:160]}"
    return "traceback", f"exit {code}, {len(lines)} stderr lines: {(lines or [''])[0][:160]}"


def _last_frame(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(error).__name__}{where}: {str(error)[:140]}"


def good_plan(d: Path) -> tuple[str, dict]:
    from hexiseq import plan_search

    plan = plan_search("cpu-emulated-2type", "tiny", 512).best
    path = d / "good-plan.json"
    plan.to_json(path)
    return str(path), json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--no-results", action="store_true", help="print only")
    args = parser.parse_args(argv)
    os.environ.pop("HEXISEQ_STORE_URL", None)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        d = Path(scratch)
        os.chdir(d)  # a default store, if anything wrote one, lands here
        plan_path, plan_document = good_plan(d)
        cases = cli_cases(d, plan_path, plan_document) + api_cases(d, plan_path)
        results = []
        for case in cases:
            outcome, detail = judge(case, args.timeout_s)
            results.append((case, outcome, detail))
            print(f"{outcome:9} {case.entry} [{case.label}]: {detail}", file=sys.__stdout__)
    elapsed_s = time.perf_counter() - began
    text = report(results, elapsed_s)
    print(text)
    if not args.no_results:
        replace_section("bad_inputs", text)
    return 0


def report(results, elapsed_s: float) -> str:
    by_entry: dict[str, Counter] = {}
    for case, outcome, _ in results:
        by_entry.setdefault(case.entry, Counter())[outcome] += 1
    total = Counter(outcome for _, outcome, _ in results)
    lines = [
        "Command: `.venv/bin/python benchmarks/bad_inputs.py` (2-core CPU, one process, "
        f"{len(results)} bad inputs, {elapsed_s:.0f} s).",
        "",
        "| entry point | cases | " + " | ".join(OUTCOMES) + " |",
        "|---|---:|" + "---:|" * len(OUTCOMES),
    ]
    for entry, counts in by_entry.items():
        cells = " | ".join(str(counts[o]) for o in OUTCOMES)
        lines.append(f"| {entry} | {sum(counts.values())} | {cells} |")
    cells = " | ".join(f"**{total[o]}**" for o in OUTCOMES)
    lines.append(f"| **all** | **{len(results)}** | {cells} |")
    unclear = [(c, o, d) for c, o, d in results if o != "clear"]
    lines += ["", f"Not clear ({len(unclear)}):" if unclear else "Every case was clear."]
    lines += [f"- {o}: {c.entry} [{c.label}]: {d}" for c, o, d in unclear]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
