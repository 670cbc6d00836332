"""A drafter trained on the last layer's own output (`last_layer: pre_norm`) runs through the workflow.

Its layer set is named L...-prenorm. Before, the Snakefile's wildcard constraint admitted only L1-2-3, so
`snakemake` planned nothing for such a drafter ("Nothing to be done") and naming its metrics gave a
MissingInputException: the drafter was silently never evaluated.
"""

from __future__ import annotations

from dflash_eval.testing.workflow import (
    add_hf_drafter,
    check,
    job,
    load_config,
    save_config,
    snakemake,
    tiny_project,
)
from tests.support.checkout import copy_workflow


def test_a_pre_norm_drafter_is_extracted_evaluated_and_reported(tmp_path):
    workflow = copy_workflow(tmp_path / "workflow")
    root = tmp_path / "project"
    tiny_project(root, drafters=1, datasets=1, big_checkpoint=False)
    config = load_config(root)
    add_hf_drafter(root, config, "pre", seed=7, layer_ids=[1, 3])  # layer 3 is the tiny target's last (4 layers)
    config["drafters"]["pre"]["last_layer"] = "pre_norm"
    save_config(root, config)
    check(snakemake(workflow, root))
    calls = (root / "calls.log").read_text().splitlines()
    assert "extract results/hidden/d1/L1-3-prenorm" in calls
    assert "evaluate results/eval/pre/d1/metrics.json" in calls
    assert [c for c in calls if not c.startswith("export ")][-1].startswith("report ")  # exports may finish last
    manifest = root / "results" / "hidden" / "d1" / "L1-3-prenorm" / "manifest.json"
    assert manifest.is_file()
    dry = snakemake(workflow, root, "-n")
    assert "Nothing to be done" in dry.stdout + dry.stderr, "the run is complete, the pre-norm drafter included"
    assert job("evaluate", "pre", "d1") not in (dry.stdout + dry.stderr)
