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

from trl_grid import GEN_MODES, check_cell, run_cell  # noqa: E402

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


def test_the_covering_subset_spans_every_layout():
    assert len(LAYOUTS) == 16 and {c[:3] for c in COVER} == set(LAYOUTS)
    assert {c[3] for c in COVER} == set(LOSSES) and {c[4] for c in COVER} == {False, True}
    assert {c[5] for c in COVER} == set(GEN_MODES) and len(FULL) == 288


@pytest.mark.parametrize("cell", COVER, ids=_id)
def test_grid_cell(model_dir, tmp_path, monkeypatch, cell):
    ga, spg, mu, loss, trunc, gen = cell
    check_cell(run_cell(model_dir, tmp_path / "out", ga=ga, spg=spg, mu=mu, loss=loss, trunc=trunc, gen=gen,
                        monkeypatch=monkeypatch))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("HDREPLAY_FULL_GRID") != "1", reason="full grid: set HDREPLAY_FULL_GRID=1")
@pytest.mark.parametrize("cell", [c for c in FULL if c not in COVER], ids=_id)
def test_full_grid_cell(model_dir, tmp_path, monkeypatch, cell):
    ga, spg, mu, loss, trunc, gen = cell
    check_cell(run_cell(model_dir, tmp_path / "out", ga=ga, spg=spg, mu=mu, loss=loss, trunc=trunc, gen=gen,
                        monkeypatch=monkeypatch))
