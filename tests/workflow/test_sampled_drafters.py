"""A DFlash2 (candidate-selector) drafter on a sampled dataset is refused when the workflow loads, whatever
evaluation.verify says: SGLang 0.5.23 samples its selector's path at T > 0, which is not computed here, and the
greedy-draft number would be one no engine produces (evaluate/drafter_kind.py). Greedy datasets keep it."""

from __future__ import annotations

from dflash_eval.testing.workflow import snakemake
from tests.support.finished_project import refused


def test_a_dflash2_drafter_on_a_sampled_dataset_is_refused_at_load(case):
    workflow, root = case
    (root / "ckpt" / "a" / "config.json").write_text('{"block_size": 4, "architectures": ["DFlash2DraftModel"]}')
    (root / "extra.yaml").write_text("datasets:\n  d2:\n    temperature: 0.7\n")
    out = refused(workflow, root, "--configfile", str(root / "extra.yaml"))
    assert (
        "drafters.a (in config.yaml): drafter a is a DFlash2DraftModel, and datasets d2 sample (temperature > 0)" in out
    ), out
    assert "greedy-draft tau" in out and "datasets are greedy" in out and "drafters.b" not in out
    run = snakemake(workflow, root, "-n")  # greedy datasets only: no refusal
    assert run.returncode == 0 and "DFlash2DraftModel" not in run.stdout + run.stderr, run.stdout + run.stderr
