"""Distributed checkpoints (`runtime.checkpoint`): saved at one split of the model states,
loaded at another, with no pickle.

A 3-rank job (uneven state shares 0.5 / 0.3 / 0.2) trains two AdamW steps on random tokens,
saves, writes the whole states it saved (gathered, as safetensors) and runs one more step.
New jobs load that checkpoint at 2 ranks (shares 0.8 / 0.2) and at 4 ranks as two replicas
of 2 (one replica's second rank holds no state): every whole parameter and AdamW moment
equals the saved one exactly, the step is the saved one and the next step's loss is the
uninterrupted job's. The replicas then save again (one replica writing) and one process
loads that. One-process cases check the files, interrupted saves and bad input.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from model_cases import zigzag
from safetensors.torch import load_file, save_file

from hexiseq import InputError, ModelSpec
from hexiseq.runtime.checkpoint import (
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    unit_names,
)

SPEC = ModelSpec.preset("tiny")
SEED = 20261201
LEARNING_RATE = 1e-2  # large enough that the moments and the step count matter
SAVED_STEP = 2  # the checkpoint is taken after steps 0 and 1: step 2 runs next
BATCH = 2
TOLERANCE = 1e-5  # relative, the next step's loss at another split
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's states shaped like the master

LAYOUT_3 = zigzag("tiny", [[2, 0], [1]], [28, 12], [[2, 1], [1]], [[3, 5], [8]])
LAYOUT_2 = zigzag("tiny", [[1, 0]], [40], [[1, 3]], [[5, 3]])
LAYOUT_2_RING = zigzag("tiny", [[0], [1]], [24, 16], [[1], [1]], [[8], [8]])


def step_tokens(step: int) -> torch.Tensor:
    """Random token ids (B, S) of `step`, the same on every rank and every job."""
    generator = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    return torch.randint(0, SPEC.vocab, (BATCH, LAYOUT_2.seq_len), generator=generator)


def build(layout, fractions, group=None, seed: int = SEED):
    """The tiny model over `CPHPAttention` of `group`, its states sharded in `fractions`
    (drawn from `seed`), and AdamW over them as `train.build_optimizer` makes it."""
    from hexiseq.runtime import CPHPAttention, build_model
    from hexiseq.runtime.sharding import shard_model_states

    model = build_model(SPEC, CPHPAttention(layout, group), device="meta")
    shard_model_states(model, fractions, group=group, seed=seed, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)
    return model, optimizer


def train_step(model, optimizer, layout, local_rank: int, step: int, group=None) -> float:
    """One AdamW step on `step`'s tokens; the loss (mean over the whole sequence)."""
    from hexiseq.runtime.loss import chunked_next_token_loss, next_token_labels
    from hexiseq.runtime.model import token_positions

    tokens = step_tokens(step)
    positions = token_positions(layout, local_rank)
    hidden = model.hidden_states(tokens[:, positions], positions)
    labels = next_token_labels(tokens, positions)
    loss = chunked_next_token_loss(hidden, model.lm_head.weight, labels, group=group)
    loss.local_share.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.global_loss.item()


def whole_states(model, optimizer) -> dict[str, torch.Tensor]:
    """Every whole parameter by name and every unit's whole flat master and AdamW moments
    (`{unit}.exp_avg` ...), gathered exactly (a sum with zeros) over each unit's group."""
    units = model.sharded_states.units
    whole = dict(model.sharded_states.full_parameters())
    for name, unit in zip(unit_names(units), units):
        start = sum(unit.counts[: unit.rank])
        adamw = optimizer.state[unit.master]
        pieces = {"master": unit.master.detach(), **{k: adamw[k] for k in MOMENTS}}
        for kind, piece in pieces.items():
            flat = torch.zeros(unit.numel)
            flat[start : start + piece.numel()] = piece
            if dist.is_initialized():
                dist.all_reduce(flat, group=unit.group)
            whole[f"{name}.{kind}"] = flat
        whole[f"{name}.adamw_step"] = adamw["step"].reshape(1).clone()
    return whole


def assert_equal_states(actual: dict, expected: dict, where: str) -> None:
    assert actual.keys() == expected.keys(), where
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{where}: {key} differs"


def save_job(rank: int, world_size: int, folder: str) -> None:
    """3 ranks, shares 0.5 / 0.3 / 0.2: two steps, save, the saved states, one more step."""
    root = Path(folder)
    model, optimizer = build(LAYOUT_3, [0.5, 0.3, 0.2])
    for step in range(SAVED_STEP):
        train_step(model, optimizer, LAYOUT_3, rank, step)
    path = save_checkpoint(root / "run", SAVED_STEP, model, optimizer)
    saved = whole_states(model, optimizer)
    next_loss = train_step(model, optimizer, LAYOUT_3, rank, SAVED_STEP)
    if rank == 0:
        save_file(saved, root / "saved.safetensors")
        (root / "next_loss.json").write_text(json.dumps({"path": str(path), "loss": next_loss}))


def load_job_2(rank: int, world_size: int, folder: str) -> None:
    """2 ranks, shares 0.8 / 0.2, states drawn from another seed, then loaded."""
    root = Path(folder)
    record = json.loads((root / "next_loss.json").read_text())
    model, optimizer = build(LAYOUT_2, [0.8, 0.2], seed=SEED + 1)
    assert load_checkpoint(record["path"], model, optimizer) == SAVED_STEP
    expected = load_file(root / "saved.safetensors")
    assert_equal_states(whole_states(model, optimizer), expected, f"rank {rank}")
    loss = train_step(model, optimizer, LAYOUT_2, rank, SAVED_STEP)
    assert abs(loss - record["loss"]) / abs(record["loss"]) <= TOLERANCE, (loss, record)


def load_job_replicas(rank: int, world_size: int, folder: str) -> None:
    """4 ranks as two replicas of 2 (shares 0.6 / 0.4, and 1.0 / 0.0: an empty shard), each
    replica training on the whole batch; load, check, one step, save again (replica 1
    writes) and record the states it saved."""
    root = Path(folder)
    record = json.loads((root / "next_loss.json").read_text())
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica, local_rank = divmod(rank, 2)
    layout = (LAYOUT_2, LAYOUT_2_RING)[replica]
    fractions = ([0.6, 0.4], [1.0, 0.0])[replica]
    model, optimizer = build(layout, fractions, groups[replica], seed=SEED + 2)
    assert load_checkpoint(record["path"], model, optimizer) == SAVED_STEP
    expected = load_file(root / "saved.safetensors")
    assert_equal_states(whole_states(model, optimizer), expected, f"rank {rank}")
    loss = train_step(model, optimizer, layout, local_rank, SAVED_STEP, groups[replica])
    assert abs(loss - record["loss"]) / abs(record["loss"]) <= TOLERANCE, (loss, record)
    save_checkpoint(root / "replicas", SAVED_STEP + 1, model, optimizer, writes=replica == 1)
    saved = whole_states(model, optimizer)
    if rank == 2:
        save_file(saved, root / "replicas_saved.safetensors")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """The folder of the 3-rank job (`save_job`)."""
    folder = tmp_path_factory.mktemp("checkpoints")
    run_distributed(save_job, 3, str(folder))
    return folder


def tensor_files(checkpoint: Path) -> list[str]:
    """The checkpoint's file names besides the manifest, which it must hold."""
    names = sorted(path.name for path in checkpoint.iterdir())
    assert MANIFEST_NAME in names
    return [name for name in names if name != MANIFEST_NAME]


@pytest.mark.multiproc
def test_a_checkpoint_loads_into_two_ranks_with_other_shares(saved_run):
    step, path = latest_checkpoint(saved_run / "run")
    assert step == SAVED_STEP
    assert tensor_files(path) == [  # one per rank, nothing else (no DCP .metadata pickle)
        f"shard-0000{rank}-model-00001-of-00001.safetensors" for rank in (1, 2, 3)
    ]
    run_distributed(load_job_2, 2, str(saved_run))


@pytest.mark.multiproc
def test_a_checkpoint_loads_into_replicas_and_one_replica_saves(saved_run):
    run_distributed(load_job_replicas, 4, str(saved_run))
    step, path = latest_checkpoint(saved_run / "replicas")
    assert step == SAVED_STEP + 1
    # Replica 1 wrote: only global rank 2 (its rank 3 holds no state) has a file.
    assert tensor_files(path) == ["shard-00003-model-00001-of-00001.safetensors"]
    model, optimizer = one_process_model()
    assert load_checkpoint(path, model, optimizer) == SAVED_STEP + 1
    expected = load_file(saved_run / "replicas_saved.safetensors")
    assert_equal_states(whole_states(model, optimizer), expected, "one process")


def one_process_model(model_name: str = "tiny", seed: int = SEED + 3):
    """A model on this process alone (no process group: one rank holds every shard)."""
    from hexiseq.runtime import LocalAttention, build_model
    from hexiseq.runtime.sharding import shard_model_states

    model = build_model(ModelSpec.preset(model_name), LocalAttention(), device="meta")
    shard_model_states(model, seed=seed, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)
    return model, optimizer


def trained_one_process(steps: int = 1):
    """A one-process model after `steps` AdamW steps on random gradients."""
    model, optimizer = one_process_model()
    generator = torch.Generator().manual_seed(SEED)
    for _ in range(steps):
        for parameter in model.parameters():
            parameter.grad = torch.randn(parameter.shape, generator=generator)
        optimizer.step()
    return model, optimizer


@pytest.fixture(scope="module")
def one_process_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of step 5 saved by one process."""
    model, optimizer = trained_one_process()
    return save_checkpoint(tmp_path_factory.mktemp("one"), 5, model, optimizer)


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])


def test_a_checkpoint_holds_only_json_and_safetensors(one_process_checkpoint):
    """No pickle: no DCP `.metadata`, no torch.save file; the manifest and every tensor
    file's header are JSON, and nothing but tensor data follows a header."""
    files = sorted(p.name for p in one_process_checkpoint.iterdir())
    assert files == [MANIFEST_NAME, "shard-00001-model-00001-of-00001.safetensors"]
    manifest = json.loads((one_process_checkpoint / MANIFEST_NAME).read_text())
    assert manifest["step"] == 5
    assert [u["adamw_step"] for u in manifest["units"]] == [1] * (SPEC.layers + 1)
    tensor_file = one_process_checkpoint / files[1]
    header = safetensors_header(tensor_file)
    names = {key for key in header if key != "__metadata__"}
    units = ["root", *(f"blocks.{i}" for i in range(SPEC.layers))]
    assert names == {f"{unit}.{kind}" for unit in units for kind in ("master", *MOMENTS)}
    data_bytes = max(entry["data_offsets"][1] for key, entry in header.items() if key in names)
    (length,) = struct.unpack("<Q", tensor_file.read_bytes()[:8])
    assert tensor_file.stat().st_size == 8 + length + data_bytes


def test_one_process_round_trip_and_replacing_a_step(tmp_path):
    """Saved and loaded by one process; saving a step again replaces it, and the folder of a
    crashed save of that step is cleared first."""
    model, optimizer = trained_one_process(steps=2)
    (tmp_path / f"step-00000003{PARTIAL_SUFFIX}").mkdir()  # a crashed save's leftovers
    first = save_checkpoint(tmp_path, 3, *trained_one_process(steps=1))
    assert save_checkpoint(tmp_path, 3, model, optimizer) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]
    loaded, loaded_optimizer = one_process_model(seed=SEED + 9)
    assert load_checkpoint(first, loaded, loaded_optimizer) == 3
    expected = whole_states(model, optimizer)
    assert_equal_states(whole_states(loaded, loaded_optimizer), expected, "one process")


def test_interrupted_saves_are_ignored(one_process_checkpoint, tmp_path):
    assert latest_checkpoint(tmp_path / "none") is None
    assert latest_checkpoint(tmp_path) is None
    shutil.copytree(one_process_checkpoint, tmp_path / "step-00000005")
    shutil.copytree(one_process_checkpoint, tmp_path / f"step-00000009{PARTIAL_SUFFIX}")
    interrupted = tmp_path / "step-00000008"  # renamed by hand, its manifest never written
    shutil.copytree(one_process_checkpoint, interrupted)
    (interrupted / MANIFEST_NAME).unlink()
    assert latest_checkpoint(tmp_path) == (5, tmp_path / "step-00000005")


def broken_copy(source: Path, target: Path, breakage: str) -> Path:
    """A copy of the checkpoint `source` at `target` broken in one way."""
    shutil.copytree(source, target)
    manifest = target / MANIFEST_NAME
    tensor_file = next(target.glob("*.safetensors"))
    if breakage == "no manifest":
        manifest.unlink()
        (target / ".metadata").write_bytes(b"\x80\x04\x95")  # a foreign DCP pickle
    elif breakage == "manifest not JSON":
        manifest.write_text("{step: 5")
    elif breakage == "foreign manifest":
        manifest.write_text(json.dumps({"format": "something-else", "step": 5}))
    elif breakage == "truncated tensors":
        tensor_file.write_bytes(tensor_file.read_bytes()[:100])
    elif breakage == "no tensors":
        tensor_file.unlink()
    elif breakage == "foreign tensors":
        save_file({"weight": torch.randn(3)}, target / "extra.safetensors")
    return target


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("missing", "no such folder"),
        ("no manifest", "not a complete hexiseq checkpoint"),
        ("manifest not JSON", "not readable JSON"),
        ("foreign manifest", "not a hexiseq-checkpoint manifest"),
        ("truncated tensors", "corrupt .safetensors file"),
        ("no tensors", r"lack \['blocks.0.exp_avg'"),
        ("foreign tensors", r"foreign tensors \['weight'\]"),
    ],
)
def test_bad_checkpoints_are_refused_in_one_line(
    one_process_checkpoint, tmp_path, breakage, message
):
    target = tmp_path / "step-00000005"
    if breakage != "missing":
        broken_copy(one_process_checkpoint, target, breakage)
    model, optimizer = one_process_model()
    with pytest.raises(InputError, match=message) as raised:
        load_checkpoint(target, model, optimizer)
    assert "\n" not in str(raised.value) and str(target) in str(raised.value)


def test_a_checkpoint_of_another_model_is_refused(one_process_checkpoint):
    model, optimizer = one_process_model("tiny-7h")
    with pytest.raises(InputError, match="of another model: unit root holds"):
        load_checkpoint(one_process_checkpoint, model, optimizer)


def test_a_negative_step_is_refused(tmp_path):
    with pytest.raises(InputError, match="step must be an integer >= 0"):
        save_checkpoint(tmp_path, -1, *one_process_model())


def test_a_save_that_nobody_writes_is_not_published(tmp_path):
    with pytest.raises(ValueError, match="exactly one replica"):
        save_checkpoint(tmp_path, 1, *one_process_model(), writes=False)
    assert latest_checkpoint(tmp_path) is None
