"""The plots: every registered plot renders at 1200 x 600 px and is not blank; training runs get a line each."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest

from dflash_eval.report import plots


@pytest.mark.parametrize("name", sorted(plot.file for plot in plots.PLOTS.values()))
def test_plots_open_at_the_expected_size_and_are_not_blank(out, name):
    pixels = matplotlib.image.imread(out / "plots" / name)
    assert pixels.shape[:2] == (600, 1200)
    assert pixels[..., :3].var() > 0
    assert not list((out / "plots").glob(".*"))          # no temporary files left behind


def test_training_runs_get_one_line_each():
    rows = [{"drafter": d, "dataset": "x", "primary": True, "training_step": step}
            for d, step in (("a1", 100), ("a2", 200), ("b1", 100), ("c", None))]
    settings = {"drafters": {"a1": {"run": "A"}, "a2": {"run": "A"}, "b1": {}, "c": {"run": "A"}}}
    runs = plots.training_runs(rows, settings)
    assert {run: [r["drafter"] for r in members] for run, members in runs.items()} == {
        "A": ["a1", "a2"], plots.DEFAULT_RUN: ["b1"]}


def test_every_registered_plot_has_a_caption_and_its_own_file():
    captions = Path(__file__).resolve().parents[2] / "workflow" / "report"
    for name, plot in plots.PLOTS.items():
        assert (captions / plot.caption).read_text().strip(), f"{name}: caption {plot.caption} is empty"
    files = [plot.file for plot in plots.PLOTS.values()]
    assert len(set(files)) == len(files) and all(file.endswith(".png") for file in files)
