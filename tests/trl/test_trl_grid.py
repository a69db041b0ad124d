"""The settings grid through ``HDRGRPOTrainer.train()``: GA x steps_per_generation x num_iterations x loss type
x mask_truncated_completions x generation backend (transformers, vLLM stand-in colocate / server).

Every cell must replay, and no group may be replayed before a weight update since its birth (checked from
the recorded optimizer step of every replay chunk and from the ratios it trained with; see trl_grid.py).
The default suite runs a covering subset (every GA / spg / num_iterations combination once, loss type,
truncation masking and backend rotating); ``HDREPLAY_FULL_GRID=1`` runs all 288 cells.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from trl_grid import GEN_MODES, cell_args, check_cell, run_cell  # noqa: E402

LAYOUTS = sorted({(ga, spg, mu) for ga in (1, 2, 4) for spg in (1, ga, 2 * ga) for mu in (1, 2)})
LOSSES = ("dapo", "grpo", "cispo")
FULL = [(*lay, loss, trunc, gen) for lay in LAYOUTS for loss in LOSSES for trunc in (False, True) for gen in GEN_MODES]
COVER = [(*lay, LOSSES[i % 3], bool(i % 2), GEN_MODES[(i // 2) % 3]) for i, lay in enumerate(LAYOUTS)]


def _id(c):
    ga, spg, mu, loss, trunc, gen = c
    return f"ga{ga}-spg{spg}-mu{mu}-{loss}-{'trunc' if trunc else 'full'}-{gen}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("grid_models")


def cell_of(args) -> tuple:
    """The grid cell a trainer config is, read back from the config TRL validated (and may have normalised)."""
    return (args.gradient_accumulation_steps, args.steps_per_generation, args.num_iterations, args.loss_type,
            args.mask_truncated_completions, args.vllm_mode if args.use_vllm else "hf")


def test_the_covering_subset_spans_every_layout(tmp_path):
    """The configs the covered cells train with (cell_args, through HDRGRPOConfig / GRPOConfig validation) are those
    cells, and they span every layout, loss type, masking choice and backend: a knob cell_args drops or TRL
    normalises away leaves part of the grid untested while every cell still passes."""
    built = [cell_of(cell_args(tmp_path / _id(c), ga=c[0], spg=c[1], mu=c[2], loss=c[3], trunc=c[4], gen=c[5]))
             for c in COVER]
    assert built == COVER
    assert len(LAYOUTS) == 16 and {c[:3] for c in built} == set(LAYOUTS) and len(FULL) == 288
    assert {c[3] for c in built} == set(LOSSES) and {c[4] for c in built} == {False, True}
    assert {c[5] for c in built} == set(GEN_MODES)


@pytest.mark.parametrize("cell", COVER, ids=_id)
def test_grid_cell(model_dir, tmp_path, monkeypatch, cell):
    ga, spg, mu, loss, trunc, gen = cell
    tr = run_cell(model_dir, tmp_path / "out", ga=ga, spg=spg, mu=mu, loss=loss, trunc=trunc, gen=gen,
                  monkeypatch=monkeypatch)
    assert cell_of(tr.args) == cell  # the trainer ran the cell it was given
    check_cell(tr)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("HDREPLAY_FULL_GRID") != "1", reason="full grid: set HDREPLAY_FULL_GRID=1")
@pytest.mark.parametrize("cell", [c for c in FULL if c not in COVER], ids=_id)
def test_full_grid_cell(model_dir, tmp_path, monkeypatch, cell):
    ga, spg, mu, loss, trunc, gen = cell
    check_cell(run_cell(model_dir, tmp_path / "out", ga=ga, spg=spg, mu=mu, loss=loss, trunc=trunc, gen=gen,
                        monkeypatch=monkeypatch))
