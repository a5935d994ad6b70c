"""Stores and studies under concurrency, kill -9 and a full disk (issue 17's re-measure).

    .venv/bin/python benchmarks/store_safety.py [--postgresql URL] [--processes 87] [--kills 32]

1. Concurrency: `--processes` Python processes started at once against one NEW store and one
   NEW Optuna study: a third save plans to the new store, a third run a search on the new
   study, a third open one copy of a store written before migrations (the migration race) and
   save a plan to it. Each prints the ids the store acknowledged (after commit).
   Counted: processes that failed (and of them, with a traceback), acknowledged rows missing,
   duplicate trial numbers, trials left RUNNING.
2. Kills: `--kills` times, a writer is killed with SIGKILL at a random moment after its first
   acknowledged write: a process saving plans in a loop, a profile sweep, a stored search, or
   the ranks of a `hexiseq run`. Then: the SQLite file passes `PRAGMA integrity_check`, every
   acknowledged row is there, the sweep resumes to the full grid without a duplicate, the run
   is recorded "failed" with why.
3. Full disk (a 4 MiB tmpfs; needs root): `hexiseq plan --out` over an existing plan file, a
   plan saved to a store, and a profile sweep, each on a full disk; then the sweep again
   after space is freed.

Writes the table into benchmarks/RESULTS.md (SQLite always, PostgreSQL with --postgresql or
$HEXISEQ_TEST_POSTGRESQL_URL).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import replace_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
V1_STORE = REPO / "tests" / "core" / "data" / "store-v1.db"

SAVE_PLANS = """
import sys
from hexiseq.plan import Plan
from hexiseq.store import Store
plan = Plan.from_json(sys.argv[2])
with Store.open(sys.argv[1]) as store:
    for i in range(int(sys.argv[3])):
        print("plan", store.save_plan_object(plan, f"w{i}"), flush=True)
"""
SEARCH = """
import sys
from hexiseq.errors import HexiseqError
from hexiseq.search import plan_search
try:
    plan_search("cpu-emulated-2type", "tiny", 512, n_trials=int(sys.argv[2]),
                storage=sys.argv[1], study_name="shared")
except HexiseqError as error:  # the API's one clear line, as the CLI prints it
    sys.exit(f"error: {error}")
print("searched", flush=True)
"""


@dataclass
class Tally:
    """What one part measured: counts by name, and notes of what went wrong."""

    counts: dict[str, int | str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _environment() -> dict[str, str]:
    environment = dict(os.environ)
    environment.pop("HEXISEQ_STORE_URL", None)
    return environment


def _start(code_or_argv: str | list[str], *args: str) -> subprocess.Popen:
    argv = [PYTHON, "-c", code_or_argv, *args] if isinstance(code_or_argv, str) else code_or_argv
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_environment(), start_new_session=True)  # fmt: skip


def _acknowledged(stdout: str, kind: str = "plan") -> list[int]:
    return [int(line.split()[1]) for line in stdout.splitlines() if line.startswith(kind + " ")]


def _plan_ids(url: str) -> set[int]:
    from hexiseq.store import Store

    with Store.open(url) as store:
        return {record.id for record in store.list_plans()}


def _study_trials(url: str) -> tuple[int, int, int]:
    """(trials, duplicate numbers, trials left RUNNING) of study "shared"."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trials = optuna.load_study(study_name="shared", storage=url).get_trials(deepcopy=False)
    numbers = [t.number for t in trials]
    running = sum(t.state == optuna.trial.TrialState.RUNNING for t in trials)
    return len(trials), len(numbers) - len(set(numbers)), running


def concurrency(store_url: str, study_url: str, v1_url: str, plan_path: str, processes: int):
    """All writers at once on a new store, a new study and an old store."""
    per_kind = processes // 3
    started = time.perf_counter()
    jobs = [("store", _start(SAVE_PLANS, store_url, plan_path, "3")) for _ in range(per_kind)]
    jobs += [("study", _start(SEARCH, study_url, "2")) for _ in range(per_kind)]
    jobs += [("migrate", _start(SAVE_PLANS, v1_url, plan_path, "1"))
             for _ in range(processes - 2 * per_kind)]  # fmt: skip
    tally = Tally()
    failed = tracebacks = 0
    acknowledged = {"store": [], "migrate": []}
    for kind, job in jobs:
        out, err = job.communicate(timeout=900)
        if job.returncode != 0:
            failed += 1
            tracebacks += "Traceback" in err
            tally.notes.append(f"{kind} exit {job.returncode}: {err.strip().splitlines()[-1:]}")
        if kind in acknowledged:
            acknowledged[kind] += _acknowledged(out)
    missing = len(set(acknowledged["store"]) - _plan_ids(store_url))
    missing += len(set(acknowledged["migrate"]) - _plan_ids(v1_url))
    trials, duplicates, running = _study_trials(study_url)
    tally.counts.update({
        "processes": len(jobs), "failed": failed, "with a traceback": tracebacks,
        "rows acknowledged": len(acknowledged["store"]) + len(acknowledged["migrate"]),
        "acknowledged rows missing": missing, "study trials": trials,
        "duplicate trial numbers": duplicates, "trials left RUNNING": running,
        "wall s": round(time.perf_counter() - started),
    })  # fmt: skip
    return tally


def _integrity(path: Path) -> str:
    with sqlite3.connect(path) as connection:
        return connection.execute("PRAGMA integrity_check").fetchone()[0]


def _kill_tree(job: subprocess.Popen) -> str:
    """SIGKILL to the job, its session and every process below it; returns what it printed."""
    below = _descendants(job.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return job.communicate()[0]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    below, frontier = [], [pid]
    while frontier:
        found = children.get(frontier.pop(), [])
        below += found
        frontier += found
    return below


def _ranks(launcher_pid: int) -> list[int]:
    ranks = []
    for pid in _descendants(launcher_pid):
        with contextlib.suppress(OSError):
            command = (Path("/proc") / str(pid) / "cmdline").read_bytes()
            if b"hexiseq.runtime.train" in command and b"torch.distributed.run" not in command:
                ranks.append(pid)
    return ranks


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(path: Path, query: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as connection:
                if connection.execute(query).fetchone()[0]:
                    return True
        except sqlite3.Error:
            pass
        time.sleep(0.1)
    return False


def kills(d: Path, plan_path: str, cpu_plan_path: str, count: int, rng: random.Random):
    """`count` writers killed mid-write; what each left behind."""
    tally = Tally()
    outcome = {"killed": 0, "integrity ok": 0, "acknowledged rows missing": 0,
               "sweeps resumed whole": 0, "sweep duplicates": 0,
               "runs failed with why": 0, "runs left running": 0}  # fmt: skip
    kinds = ["plans", "profile", "search", "run"]
    for index in range(count):
        kind = kinds[index % len(kinds)]
        path = d / f"kill-{index}.db"
        url = f"sqlite:///{path}"
        if kind == "plans":
            job = _start(SAVE_PLANS, url, plan_path, "100000")
            ready = _wait_for(path, "SELECT COUNT(*) FROM plans", 60)
        elif kind == "profile":
            job = _start([PYTHON, "-m", "hexiseq.cli", "profile", "--device", "cpu", "--quick",
                          "--store", url])  # fmt: skip
            ready = _wait_for(path, "SELECT COUNT(*) FROM profile_measurements", 120)
        elif kind == "search":
            job = _start(SEARCH, url, "400")
            ready = _wait_for(path, "SELECT COUNT(*) FROM trials", 120)
        else:
            launch = [PYTHON, "-m", "hexiseq.cli", "run", "--plan", cpu_plan_path, "--steps",
                      "100000", "--store", url, "--device", "cpu"]  # fmt: skip
            job = _start(launch)
            ready = _wait_for(path, "SELECT COUNT(*) FROM runtime_measurements", 120)
        if not ready:
            tally.notes.append(f"kill {index} ({kind}): no write within the wait")
        time.sleep(rng.uniform(0.0, 1.5))
        if kind == "run":
            printed = _kill_run(job, ranks_first=index % 8 == 3, tally=tally, index=index)
        else:
            printed = _kill_tree(job)  # everything dies at once
        outcome["killed"] += 1
        acknowledged = _acknowledged(printed)
        outcome["integrity ok"] += _integrity(path) == "ok"
        _check_after_kill(kind, url, path, acknowledged, outcome, tally, index)
    tally.counts.update(outcome)
    return tally


def _kill_run(job: subprocess.Popen, ranks_first: bool, tally: Tally, index: int) -> str:
    """Kill the ranks (the launcher sees torchrun fail), or the launcher and torchrun (the
    ranks, in sessions of their own, must notice and stop); returns what the launcher printed."""
    ranks = _ranks(job.pid)
    if ranks_first:
        for pid in ranks:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    if any(_alive(pid) for pid in ranks):
        tally.notes.append(f"kill {index}: ranks still alive 90 s after the launcher died")
    try:
        return job.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        return _kill_tree(job)


def _check_after_kill(kind, url, path, acknowledged, outcome, tally, index) -> None:
    from hexiseq.store import Store

    if kind == "plans":
        outcome["acknowledged rows missing"] += len(set(acknowledged) - _plan_ids(url))
    elif kind == "profile":
        done = subprocess.run([PYTHON, "-m", "hexiseq.cli", "profile", "--device", "cpu",
                               "--quick", "--store", url], capture_output=True, text=True,
                              env=_environment())  # fmt: skip
        with sqlite3.connect(path) as connection:
            rows = connection.execute("SELECT COUNT(*) FROM profile_measurements").fetchone()[0]
            distinct = connection.execute(
                "SELECT COUNT(*) FROM (SELECT DISTINCT device_type, op, params_json, dtype, "
                "link_class, emulation_slowdown FROM profile_measurements)"
            ).fetchone()[0]
        outcome["sweep duplicates"] += rows - distinct
        whole = done.returncode == 0 and rows == QUICK_GRID_POINTS
        outcome["sweeps resumed whole"] += whole
        if not whole:
            tally.notes.append(f"kill {index}: resumed sweep exit {done.returncode}, {rows} rows")
    elif kind == "run":
        with Store.open(url) as store:
            runs = store.list_runtime_runs()
        for run in runs:
            if run["status"] == "failed" and run["failure"]:
                outcome["runs failed with why"] += 1
            elif run["status"] == "running":
                outcome["runs left running"] += 1


QUICK_GRID_POINTS = 99
"""Points of the quick grid on this CPU (`hexiseq profile --device cpu --quick`)."""


def stale_trials(d: Path, rng: random.Random) -> Tally:
    """Stored searches killed mid-search (a search writes each trial once, finished), then
    resumed: trials kept from the killed searches, trials left RUNNING, duplicates."""
    tally = Tally()
    url = f"sqlite:///{d / 'stale.db'}"
    kept = 0
    for _ in range(3):
        job = _start(SEARCH, url, "400")
        query = f"SELECT COUNT(*) > {kept + 4} FROM trials"  # a few trials past the last kill
        _wait_for(d / "stale.db", query, 120)
        time.sleep(rng.uniform(0.2, 1.0))
        _kill_tree(job)
        kept = _study_trials(url)[0]
    _, _, running_after_kill = _study_trials(url)
    done = subprocess.run([PYTHON, "-c", SEARCH, url, "2"], env=_environment(),
                          capture_output=True, text=True)  # fmt: skip
    trials, duplicates, running = _study_trials(url)
    tally.counts.update({"kills": 3, "trials kept from the killed searches": kept,
                         "RUNNING after the kills": running_after_kill,
                         "resumed search exit code": done.returncode,
                         "trials after the resume": trials, "RUNNING after the resume": running,
                         "duplicate trial numbers": duplicates})  # fmt: skip
    return tally


def full_disk(d: Path, plan_path: str) -> Tally:
    """On a 4 MiB tmpfs filled to the brim: --out over a plan, a store write, a sweep."""
    tally = Tally()
    mount = d / "tmpfs"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        tally.notes.append(f"no tmpfs (needs root): {mounted.stderr.strip()}")
        return tally
    try:
        _full_disk_cases(mount, plan_path, tally)
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)
    return tally


def _fill(mount: Path) -> Path:
    filler = mount / "filler"
    with open(filler, "wb") as file:
        try:
            while True:
                file.write(b"\0" * 65536)
                file.flush()
        except OSError:
            pass
    return filler


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "hexiseq.cli", *argv], capture_output=True, text=True,
                          env=_environment())  # fmt: skip


def _one_line(done: subprocess.CompletedProcess) -> bool:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr


def _full_disk_cases(mount: Path, plan_path: str, tally: Tally) -> None:
    plan_file = mount / "plan.json"
    shutil.copy(plan_path, plan_file)
    store_url = f"sqlite:///{mount / 'store.db'}"
    from hexiseq.plan import Plan
    from hexiseq.store import Store

    with Store.open(store_url) as store:
        before_ids = {store.save_plan_object(Plan.from_json(plan_path), "before")}
    old_bytes = plan_file.read_bytes()
    filler = _fill(mount)
    out = _cli("plan", "--cluster", "h100x8-a100x8", "--model", "llama3-8b", "--seq-len", "64k",
               "--no-store", "--out", str(plan_file))  # fmt: skip
    tally.counts["--out on a full disk: one line, exit 2"] = _one_line(out)
    tally.counts["--out on a full disk: old plan file intact"] = (
        plan_file.read_bytes() == old_bytes
    )
    saved = _cli("plan", "--cluster", "h100x8-a100x8", "--model", "llama3-8b", "--seq-len", "64k",
                 "--store", store_url)  # fmt: skip
    tally.counts["store write on a full disk: one line"] = (
        "Traceback" not in saved.stderr and saved.returncode != 0
    )
    if saved.returncode == 0:
        tally.notes.append("a store write on the full disk succeeded (SQLite found room)")
    elif "Traceback" in saved.stderr:
        tally.notes.append(f"store write traceback: {saved.stderr.strip().splitlines()[-1]}")
    sweep_url = f"sqlite:///{mount / 'sweep.db'}"
    first = _cli("profile", "--device", "cpu", "--quick", "--store", sweep_url)
    tally.counts["sweep on a full disk: no traceback"] = "Traceback" not in first.stderr
    filler.unlink()
    with Store.open(store_url) as store:
        kept = {record.id for record in store.list_plans()} >= before_ids
    tally.counts["store rows before the full disk kept"] = kept
    tally.counts["store passes integrity_check"] = _integrity(mount / "store.db") == "ok"
    again = _cli("profile", "--device", "cpu", "--quick", "--store", sweep_url)
    with sqlite3.connect(mount / "sweep.db") as connection:
        rows = connection.execute("SELECT COUNT(*) FROM profile_measurements").fetchone()[0]
    tally.counts["sweep resumed after space freed: points"] = f"{rows}/{QUICK_GRID_POINTS}"
    if again.returncode != 0:
        tally.notes.append(f"resumed sweep exit {again.returncode}: {again.stderr[-300:]}")


def _plans(d: Path) -> tuple[str, str]:
    from hexiseq import plan_search

    gpu, cpu = d / "plan.json", d / "cpu-plan.json"
    plan_search("h100x8-a100x8", "llama3-8b", "64k").best.to_json(gpu)
    two = {"name": "two-cpu", "nodes": [{"name": "n", "gpu": "cpu", "count": 2}]}
    from hexiseq import Cluster

    plan_search(Cluster.from_dict(two), "tiny", 128).best.to_json(cpu)
    return str(gpu), str(cpu)


def _postgresql_database(server_url: str, name: str) -> str:
    import psycopg

    base = server_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(base, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}"')
        connection.execute(f'CREATE DATABASE "{name}"')
    return server_url.rsplit("/", 1)[0] + f"/{name}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=87)
    parser.add_argument("--kills", type=int, default=32)
    parser.add_argument("--postgresql", default=os.environ.get("HEXISEQ_TEST_POSTGRESQL_URL"))
    parser.add_argument("--skip-stale", action="store_true", help="skip the killed searches")
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args(argv)
    rng = random.Random(20261123)
    parts: list[tuple[str, Tally]] = []
    with tempfile.TemporaryDirectory() as scratch:
        d = Path(scratch)
        plan_path, cpu_plan_path = _plans(d)
        shutil.copy(V1_STORE, d / "v1.db")
        parts.append((f"concurrency, SQLite ({args.processes} processes)", concurrency(
            f"sqlite:///{d / 'new.db'}", f"sqlite:///{d / 'study.db'}",
            f"sqlite:///{d / 'v1.db'}", plan_path, args.processes)))  # fmt: skip
        if args.postgresql:
            store = _postgresql_database(args.postgresql, "safety_store")
            study = _postgresql_database(args.postgresql, "safety_study")
            shutil.copy(V1_STORE, d / "v1-pg.db")
            title = f"concurrency, PostgreSQL ({args.processes} processes)"
            v1_url = f"sqlite:///{d / 'v1-pg.db'}"
            parts.append((title, concurrency(store, study, v1_url, plan_path, args.processes)))
        parts.append((f"kill -9 ({args.kills} writers)", kills(d, plan_path, cpu_plan_path,
                                                                 args.kills, rng)))  # fmt: skip
        if not args.skip_stale:
            parts.append(("killed stored searches, resumed", stale_trials(d, rng)))
        parts.append(("full disk (4 MiB tmpfs)", full_disk(d, plan_path)))
        text = report(parts)
        print(text, flush=True)
    if not args.no_results:
        replace_section("store_safety", text)
    return 0


def report(parts: list[tuple[str, Tally]]) -> str:
    lines = ["Command: `.venv/bin/python benchmarks/store_safety.py` (2-core CPU).", ""]
    for title, tally in parts:
        lines += [f"**{title}**", "", "| measure | value |", "|---|---:|"]
        lines += [f"| {name} | {value} |" for name, value in tally.counts.items()]
        lines += [f"- note: {note}" for note in tally.notes]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
