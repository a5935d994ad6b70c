"""Tier 2: the sharded Llama model on 1-4 gloo ranks equals the single-process model.

Loss (the mean over every labelled token of the sequence) and every parameter gradient, after
the gradient all-reduce, against a float64 single-process model on the whole sequence.
"""

from __future__ import annotations

import pytest
from distributed import run_distributed
from model_cases import CASES, check_model_cases

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_sharded_model_matches_single_process_loss_and_gradients(world_size):
    run_distributed(check_model_cases, world_size)
