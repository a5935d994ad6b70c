"""The files of a checkpoint (`checkpoint`): its manifest, the checks of what a folder holds,
and the rename that publishes a complete save. No collective here: rank 0 or every rank
alike calls these.

The manifest (`hexiseq-checkpoint.json`) is the only file besides the safetensors files:

    {"format": "hexiseq-checkpoint", "format_version": 1, "step": 100, "torch_version": ...,
     "units": [{"name": "root", "numel": 131200, "adamw_step": 100,
                "parameters": [["embed.weight", [512, 128]], ...]}, ...]}
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from hexiseq.errors import InputError
from hexiseq.runtime.sharding import ShardedUnit

FORMAT_NAME = "hexiseq-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "hexiseq-checkpoint.json"
TENSOR_SUFFIX = ".safetensors"
PARTIAL_SUFFIX = ".partial"
TENSOR_KINDS = ("master", "exp_avg", "exp_avg_sq")
"""What is saved of each unit: the FP32 master values and AdamW's two moments."""
_CHECKPOINT_NAME = re.compile(r"step-(\d{8,})")
_UNIT_FIELDS = {"name": str, "numel": int, "adamw_step": int, "parameters": list}


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint taken before `step` runs: `step-00000100`."""
    return f"step-{step:08d}"


def unit_names(units: Sequence[ShardedUnit]) -> list[str]:
    """`root`, then `blocks.0`, `blocks.1`, ... (the order of `ShardedStates.units`)."""
    return ["root", *(f"blocks.{index}" for index in range(len(units) - 1))]


def latest_checkpoint(directory: str | os.PathLike) -> tuple[int, Path] | None:
    """The newest complete checkpoint in `directory` as (step, path), None when it holds
    none (or does not exist). Only `step-NNNNNNNN` folders with a manifest count: `.partial`
    folders of saves in progress or interrupted are ignored. Reads no tensor."""
    folder = Path(directory)
    if not folder.is_dir():
        return None
    found = []
    for child in folder.iterdir():
        match = _CHECKPOINT_NAME.fullmatch(child.name)
        if match and (child / MANIFEST_NAME).is_file():
            found.append((int(match.group(1)), child))
    return max(found, default=None)


def prune_checkpoints(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Remove all but the `keep` newest complete checkpoints in `directory` (and nothing
    else); returns what went. Rank 0 calls it after a save."""
    folder = Path(directory)
    complete = sorted(
        (int(match.group(1)), child)
        for child in (folder.iterdir() if folder.is_dir() else ())
        if (match := _CHECKPOINT_NAME.fullmatch(child.name)) and (child / MANIFEST_NAME).is_file()
    )
    gone = [path for _, path in complete[: max(len(complete) - keep, 0)]]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def build_manifest(step: int, units: Sequence[ShardedUnit], adamw_steps: Sequence[int]) -> dict:
    """The manifest of a checkpoint of `units` taken before `step` (module docstring)."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": step,
        "torch_version": torch.__version__,
        "units": [
            {
                "name": name,
                "numel": unit.numel,
                "adamw_step": adamw_step,
                "parameters": _parameters(unit),
            }
            for name, unit, adamw_step in zip(unit_names(units), units, adamw_steps, strict=True)
        ],
    }


def _parameters(unit: ShardedUnit) -> list[list]:
    return [[place.name, list(place.shape)] for place in unit.places]


def read_manifest(folder: Path) -> dict:
    """The checkpoint's manifest, checked for format, version and fields (InputError)."""
    path = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise InputError(f"checkpoint {folder}: no such folder (a step-NNNNNNNN checkpoint)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(
            f"checkpoint {folder}: no {MANIFEST_NAME}, so not a complete hexiseq checkpoint"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"checkpoint {path}: not readable JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise InputError(f"checkpoint {path}: not a {FORMAT_NAME} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise InputError(
            f"checkpoint {path}: format version {manifest.get('format_version')!r}; "
            f"this hexiseq reads version {FORMAT_VERSION}"
        )
    if not _well_formed(manifest):
        raise InputError(
            f"checkpoint {path}: malformed manifest (needs step >= 0 and units, each with "
            f"{', '.join(_UNIT_FIELDS)})"
        )
    return manifest


def _well_formed(manifest: dict) -> bool:
    step, units = manifest.get("step"), manifest.get("units")
    if not _count(step) or not isinstance(units, list):
        return False
    for unit in units:
        if not isinstance(unit, dict) or unit.keys() < _UNIT_FIELDS.keys():
            return False
        if not all(isinstance(unit.get(k), kind) for k, kind in _UNIT_FIELDS.items()):
            return False
        if not (_count(unit["numel"]) and _count(unit["adamw_step"])):
            return False
    return True


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_same_model(manifest: dict, units: Sequence[ShardedUnit], folder: Path) -> None:
    """InputError unless the checkpoint holds this model's units: same names, sizes and
    parameters (any split of them loads)."""
    saved = {unit["name"]: unit for unit in manifest["units"]}
    names = unit_names(units)
    if list(saved) != names:
        raise InputError(
            f"checkpoint {folder} is of another model: units {list(saved)}, this model has "
            f"{names}; a checkpoint loads only into the model it was saved from"
        )
    for name, unit in zip(names, units, strict=True):
        if saved[name]["numel"] != unit.numel or saved[name]["parameters"] != _parameters(unit):
            raise InputError(
                f"checkpoint {folder} is of another model: unit {name} holds "
                f"{saved[name]['numel']} elements there, {unit.numel} in this model; a "
                "checkpoint loads only into the model it was saved from"
            )


def read_tensor_metadata(reader: HuggingFaceStorageReader, folder: Path) -> Metadata:
    """DCP's metadata of the checkpoint's tensors, read from the safetensors files' JSON
    headers (InputError for a file that is not safetensors)."""
    try:
        return reader.read_metadata()
    except Exception as error:  # any failure to parse untrusted files; safetensors' own
        # error type is not importable here (the runtime imports torch and the core only)
        raise InputError(
            f"checkpoint {folder}: corrupt {TENSOR_SUFFIX} file ({type(error).__name__}: {error})"
        ) from None


def check_tensor_files(folder: Path, manifest: dict, metadata: Metadata) -> None:
    """InputError unless the safetensors files hold exactly the tensors the manifest names,
    FP32, each covered once by its saved pieces (nothing missing, foreign or overlapping)."""
    expected = {
        f"{unit['name']}.{kind}": unit["numel"]
        for unit in manifest["units"]
        for kind in TENSOR_KINDS
    }
    found = metadata.state_dict_metadata
    missing, foreign = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected)
    if missing or foreign:
        raise InputError(
            f"checkpoint {folder}: its {TENSOR_SUFFIX} files lack {missing[:3]} and hold "
            f"foreign tensors {foreign[:3]}; expected exactly each unit's "
            f"{', '.join(TENSOR_KINDS)}"
        )
    for key, numel in expected.items():
        if not _covered_once(found[key], numel):
            raise InputError(
                f"checkpoint {folder}: tensor {key} is not covered exactly once by FP32 saved "
                f"pieces (of {numel} elements); the checkpoint is incomplete or corrupt"
            )


def _covered_once(saved: object, numel: int) -> bool:
    if not isinstance(saved, TensorStorageMetadata) or len(saved.size) != 1:
        return False
    pieces = sorted((chunk.offsets[0], chunk.sizes[0]) for chunk in saved.chunks)
    position = 0
    for offset, length in pieces:
        if offset != position:
            return False
        position += length
    return position == numel and saved.properties.dtype == torch.float32


def fresh_folder(folder: Path) -> None:
    """An empty `folder` (a stale one from an interrupted save is removed)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def publish(partial: Path, final: Path, manifest: dict) -> None:
    """Check that the tensors written to `partial` are complete, write the manifest into it
    and rename it to `final` (replacing an older checkpoint of that step). The rename is
    atomic on one file system; until it, `latest_checkpoint` does not see the save. ValueError
    when the tensors are incomplete (no rank, or not every rank of a replica, wrote)."""
    try:
        metadata = read_tensor_metadata(HuggingFaceStorageReader(str(partial)), partial)
        check_tensor_files(partial, manifest, metadata)
    except InputError as error:
        raise ValueError(
            f"{error} (exactly one replica, all of its ranks, saves with writes=True)"
        ) from None
    _write_json(partial / MANIFEST_NAME, manifest)
    if final.exists():
        replaced = final.with_name(final.name + ".replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
        partial.rename(final)
        shutil.rmtree(replaced)
    else:
        partial.rename(final)
    _sync_folder(final.parent)


def _write_json(path: Path, content: dict) -> None:
    with open(path, "w", encoding="utf-8") as stream:
        json.dump(content, stream, indent=2)
        stream.flush()
        os.fsync(stream.fileno())


def _sync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX: fsync the directory)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
