"""The local stage's linear and mixed-integer programs, solved by HiGHS through highspy.

scipy's `milp` runs the same solver, but the local stage's programs have tens of columns and
are solved hundreds of times a search: scipy's input checks and sparse-matrix conversions
cost more than HiGHS's solve (0.8 ms against 0.5 ms a program at 16 GPUs). Here the
constraint matrix goes to HiGHS column-wise as built, into a fresh solver (40 us).

The solver is highspy's pybind class `_Highs`, not its `Highs` subclass: that one registers
callbacks in its constructor, which logs HiGHS's banner to standard output before any option
can be set, and `hexiseq plan --json` writes its answer there.

HiGHS runs its MIP tasks on a process-wide thread pool (of one thread here: `solve`). A
forked child inherits the pool without its threads, and its first MIP would wait on them
until the time limit; the child starts a fresh pool instead (`os.register_at_fork`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from highspy import HighsLp, HighsModelStatus, HighsVarType, MatrixFormat, kHighsInf
from highspy._core import _Highs

DEFAULT_RELATIVE_GAP = 1e-4  # HiGHS's own default
_FEASIBLE = 2  # HiGHS's kSolutionStatusFeasible: the point found satisfies every row
_STOPPED_WITH_POINT = {HighsModelStatus.kTimeLimit, HighsModelStatus.kIterationLimit}

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _Highs.resetGlobalScheduler(True))


@dataclass(frozen=True)
class Program:
    """min cost·x  subject to  row_lower <= A x <= row_upper,  lower <= x <= upper, with A
    column-wise (HiGHS's own layout: `starts`[j]..`starts`[j+1] index column j's entries
    in `rows` and `values`). An absent bound is numpy's `inf` (HiGHS's infinity too)."""

    cost: np.ndarray
    starts: np.ndarray
    rows: np.ndarray
    values: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    lower: np.ndarray
    upper: np.ndarray


def solve(
    program: Program,
    integer: np.ndarray | None = None,
    time_limit_s: float = np.inf,
    relative_gap: float = DEFAULT_RELATIVE_GAP,
) -> np.ndarray | None:
    """The optimal x, or None when the program is infeasible or unbounded; `integer` marks
    the integer columns (a MILP). A solve stopped by `time_limit_s` returns its best
    feasible point, if it has one. A MILP whose presolve fails (HiGHS's solve error: seen
    on a 32-GPU 3-type MILP that is feasible, and solved at once without presolve) is
    solved again without it."""
    milp = integer is not None and bool(np.any(integer))
    x, status = _solved(program, integer, time_limit_s, relative_gap, presolve=milp)
    if milp and status == HighsModelStatus.kSolveError:
        x, _ = _solved(program, integer, time_limit_s, relative_gap, presolve=False)
    return x


def _solved(program, integer, time_limit_s: float, relative_gap: float, presolve: bool):
    """(x or None, HiGHS's model status) of one run of a fresh solver."""
    highs = _Highs()  # one per program: HiGHS's time limit counts all runs of an instance
    highs.setOptionValue("output_flag", False)
    # One thread: HiGHS's worker threads compete for the cores with the search's helper
    # process (`search.helper`); beside it, default threads made the same 73 programs of a
    # 64-GPU search take 121 ms against 52 ms, and one thread changes no answer.
    highs.setOptionValue("threads", 1)
    if not presolve:
        # an LP of tens of columns: presolving it costs more than it saves
        highs.setOptionValue("presolve", "off")
    if integer is not None and np.any(integer):
        # The feasibility-jump heuristic (HiGHS 1.10+; an unknown option is refused quietly)
        # took 60 % of the local stage's MILPs, which close at the root node: 7.2 -> 2.8 ms a
        # program on the branch-and-bound cases of 32 and 64 GPUs of 8 types.
        highs.setOptionValue("mip_heuristic_run_feasibility_jump", False)
    highs.setOptionValue("time_limit", float(min(time_limit_s, kHighsInf)))
    highs.setOptionValue("mip_rel_gap", float(relative_gap))
    highs.passModel(_lp(program, integer))
    highs.run()
    status = highs.getModelStatus()
    found = status == HighsModelStatus.kOptimal or (
        status in _STOPPED_WITH_POINT and highs.getInfo().primal_solution_status == _FEASIBLE
    )
    return (np.array(highs.getSolution().col_value) if found else None), status


def _lp(program: Program, integer: np.ndarray | None) -> HighsLp:
    lp = HighsLp()
    lp.num_col_ = len(program.cost)
    lp.num_row_ = len(program.row_lower)
    lp.col_cost_ = np.asarray(program.cost, dtype=float)
    lp.col_lower_ = np.asarray(program.lower, dtype=float)
    lp.col_upper_ = np.asarray(program.upper, dtype=float)
    lp.row_lower_ = np.asarray(program.row_lower, dtype=float)
    lp.row_upper_ = np.asarray(program.row_upper, dtype=float)
    lp.a_matrix_.format_ = MatrixFormat.kColwise
    lp.a_matrix_.start_ = program.starts
    lp.a_matrix_.index_ = program.rows
    lp.a_matrix_.value_ = program.values
    if integer is not None and np.any(integer):
        kinds = (HighsVarType.kContinuous, HighsVarType.kInteger)
        lp.integrality_ = [kinds[int(bool(flag))] for flag in integer]
    return lp
