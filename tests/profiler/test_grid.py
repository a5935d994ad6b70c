"""Grid files: the shipped ones load; a bad one fails in one line naming the file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from hexiseq.errors import InputError
from hexiseq.profiler import BUILTIN_GRIDS, builtin_grid_path, load_grid


@pytest.mark.parametrize("quick", [True, False])
def test_shipped_grids_load(quick: bool) -> None:
    grid = load_grid(builtin_grid_path(quick))
    assert grid.name == ("quick" if quick else "full")
    assert grid.name in BUILTIN_GRIDS
    assert grid.timing.samples >= 10
    assert grid.gemm and grid.attention and grid.elementwise and grid.links


def test_full_grid_link_sizes_reach_256_MiB() -> None:
    links = load_grid(builtin_grid_path(quick=False)).links
    assert links.min_bytes == 1024 and links.max_bytes >= 256 * 1024**2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: x\ntiming: {samples: 5}\n", "timing.samples"),
        ("name: x\nbogus: 1\n", "bogus: unknown key"),
        ("name: x\ngemm: {models: [gpt-9]}\n", "unknown model preset 'gpt-9'"),
        ("name: x\nattention: {q_lens: [8], kv_lens: [8], heads: [1], head_dims: [24]}\n",
         "attention.head_dims[0]"),
        ("name: x\nlinks: {min_bytes: 1000}\n", "links.min_bytes: must be a power of two"),
        ("name: x\nlinks: {min_bytes: 4096, max_bytes: 1024}\n", "above links.max_bytes"),
        ("name: x\nlinks: {samples: 3}\n", "links.samples"),
        ("name: x\nlinks: {sizes: [1024, 1020]}\n", "links.sizes: must be a non-empty list"),
        ("name: x\nlinks: {sizes: []}\n", "links.sizes: must be a non-empty list"),
        ("name: x\nlinks: {rounds: 0}\n", "links.rounds"),
        ("name: x\ntiming: {samples: 10}\nlinks: {rounds: 11}\n",
         "links.rounds (11) is above its samples per point (10)"),
        ("name: x\ntiming: {samples: 10, rounds: 12}\n",
         "timing.rounds (12) is above its samples per point (10)"),
        ("name: x\ndtypes: {tpu: [float32]}\n", "dtypes.tpu"),
        ("timing: {}\n", "name: required field is missing"),
        ("name: [unclosed\n", "not valid YAML"),
        ("- a list\n", "must be a mapping"),
    ],
)  # fmt: skip
def test_bad_grid_is_one_line_naming_file_and_field(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InputError) as caught:
        load_grid(path)
    message = str(caught.value)
    assert "\n" not in message
    assert str(path) in message and expected in message


def test_missing_grid_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot be read"):
        load_grid(tmp_path / "absent.yaml")


def test_link_timing_overrides_the_grid_timing(tmp_path: Path) -> None:
    path = tmp_path / "links.yaml"
    path.write_text(
        "name: x\ntiming: {samples: 12, warmup_s: 0.01}\nlinks: {samples: 40, warmup_s: 0.2}\n",
        encoding="utf-8",
    )
    grid = load_grid(path)
    timing = grid.links.timing(grid.timing)
    assert (timing.samples, timing.warmup_s, timing.input_sets, timing.rounds) == (40, 0.2, 3, 5)
    assert grid.timing.samples == 12  # compute points keep the grid's timing
    plain = load_grid(builtin_grid_path(quick=True))
    assert plain.links.timing(plain.timing) == plain.timing


def test_link_sizes_listed_replace_the_powers_of_two(tmp_path: Path) -> None:
    path = tmp_path / "links.yaml"
    path.write_text("name: x\nlinks: {sizes: [4096, 1024, 4096, 3072]}\n", encoding="utf-8")
    assert load_grid(path).links.message_sizes() == [1024, 3072, 4096]
    path.write_text("name: x\nlinks: {min_bytes: 1024, max_bytes: 8192}\n", encoding="utf-8")
    assert load_grid(path).links.message_sizes() == [1024, 2048, 4096, 8192]


def test_benchmark_grid_reaches_past_the_last_level_cache() -> None:
    # benchmarks/costmodel_accuracy.py relies on it: elementwise calls up to 3.2 GB, so the
    # training two thirds hold sizes beyond a 480 MiB last-level cache.
    grid = load_grid(Path(__file__).parents[2] / "benchmarks" / "grids" / "costmodel_cpu.yaml")
    sizes = sorted(12 * n for n in grid.elementwise.numels)
    train = sizes[: len(sizes) - len(sizes) // 3]
    assert sum(size > 480 * 1024**2 for size in train) >= 3
