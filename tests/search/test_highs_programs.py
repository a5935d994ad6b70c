"""search._highs: the local stage's programs solved by HiGHS directly, checked against scipy's
`milp` (the same solver behind scipy's checks) on fresh random programs."""

import os
import select
import signal

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csc_matrix

from hexiseq.search._highs import Program, solve


def _random_program(seed: int, rows: int = 12, columns: int = 6):
    """min c·x over a random bounded polytope that holds x0 (so it is feasible)."""
    rng = np.random.default_rng(seed)
    matrix = rng.uniform(-1, 1, (rows, columns)) * (rng.random((rows, columns)) < 0.6)
    x0 = rng.uniform(0, 5, columns)
    upper_rows = matrix @ x0 + rng.uniform(0.1, 2, rows)
    lower_rows = np.where(rng.random(rows) < 0.3, matrix @ x0 - rng.uniform(0.1, 2, rows), -np.inf)
    cost = rng.uniform(-1, 1, columns)
    lower, upper = np.zeros(columns), np.full(columns, 10.0)
    return cost, matrix, lower_rows, upper_rows, lower, upper


def _program(cost, matrix, lower_rows, upper_rows, lower, upper) -> Program:
    sparse = csc_matrix(matrix)
    return Program(
        cost, sparse.indptr, sparse.indices, sparse.data, lower_rows, upper_rows, lower, upper
    )


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("integer", [False, True])
def test_programs_match_scipy_milp(seed, integer):
    cost, matrix, lower_rows, upper_rows, lower, upper = _random_program(seed)
    integrality = np.full(len(cost), int(integer))
    reference = milp(
        cost,
        constraints=LinearConstraint(matrix, lower_rows, upper_rows),
        bounds=Bounds(lower, upper),
        integrality=integrality,
    )
    x = solve(
        _program(cost, matrix, lower_rows, upper_rows, lower, upper),
        integer=integrality if integer else None,
        relative_gap=1e-9,
    )
    assert reference.x is not None and x is not None
    assert cost @ x == pytest.approx(reference.fun, rel=1e-7, abs=1e-9)
    assert np.all(matrix @ x <= upper_rows + 1e-7) and np.all(matrix @ x >= lower_rows - 1e-7)
    if integer:
        assert np.allclose(x, np.round(x), atol=1e-6)


def test_an_infeasible_program_has_no_answer():
    # x0 + x1 >= 3 with both at most 1
    program = _program(
        np.ones(2), np.ones((1, 2)), np.array([3.0]), np.array([np.inf]), np.zeros(2), np.ones(2)
    )
    assert solve(program) is None
    assert solve(program, integer=np.ones(2)) is None


def test_time_limits_do_not_add_up_across_programs():
    """HiGHS counts its time limit over every run of one solver: each program gets its own.
    2,000 solves take far more than the 20 ms limit in all (a shared solver fails after the
    first tens), while one small LP stays far below it even on a loaded machine."""
    program = _program(*_random_program(0))
    answers = [solve(program, time_limit_s=2e-2) for _ in range(2000)]
    assert all(answer is not None for answer in answers)


def test_solving_writes_nothing_to_standard_output(capfd):
    solve(_program(*_random_program(1)), integer=np.ones(6))
    assert capfd.readouterr().out == ""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_solves_a_milp():
    """HiGHS's MIP thread pool does not survive a fork: a child that used the parent's would
    wait on it forever (the benchmarks fork workers after the parent has solved MILPs)."""
    program, integer = _program(*_random_program(3, rows=30, columns=12)), np.ones(12)
    assert solve(program, integer=integer) is not None  # the parent's pool is up
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        found = solve(program, integer=integer) is not None
        os.write(writer, str(found).encode())
        os._exit(0)
    os.close(writer)
    answered, _, _ = select.select([reader], [], [], 60.0)
    if not answered:
        os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    assert answered, "the forked child never finished its MILP"
    assert os.read(reader, 10) == b"True"


def test_a_milp_whose_presolve_fails_is_solved_without_it():
    """A local-stage MILP (saved from a 32-GPU search) that is feasible but on which HiGHS's
    MILP presolve stops with a solve error: `solve` runs it again without the presolve and
    returns an integer point within every row."""
    import json
    from pathlib import Path

    saved = json.loads(
        (Path(__file__).parent / "data" / "milp_presolve_solve_error.json").read_text()
    )
    program = Program(
        *(np.array(saved[key]) for key in ("cost", "starts", "rows", "values")),
        *(
            np.array(saved[key], dtype=float)
            for key in ("row_lower", "row_upper", "lower", "upper")
        ),
    )
    integer = np.array(saved["integer"])
    x = solve(program, integer=integer, time_limit_s=10.0, relative_gap=1e-6)
    assert x is not None
    matrix = csc_matrix((program.values, program.rows, program.starts)).toarray()
    assert np.all(matrix @ x <= program.row_upper + 1e-6)
    assert np.all(matrix @ x >= program.row_lower - 1e-6)
    assert np.allclose(x[integer == 1], np.round(x[integer == 1]), atol=1e-6)
