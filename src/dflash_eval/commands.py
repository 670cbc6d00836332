"""The command table: `dflash-eval <command>` -> the module that runs it, by name (nothing is imported here).

cli.py builds its parser from it; provenance/code_version.py reads which module each stage runs,
so a stage's code fingerprint starts there, without importing the command line.
"""

from __future__ import annotations

# subcommand -> (module, add_arguments, run, help)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "demo-tokenizer": (
        "dflash_eval.demo.tokenizer",
        "add_tokenizer_arguments",
        "run_tokenizer",
        "train the demo's byte-level BPE tokenizer",
    ),
    "demo-target": (
        "dflash_eval.demo.target",
        "add_target_arguments",
        "run_target",
        "build and briefly train the demo's tiny hybrid target",
    ),
    "demo-drafters": (
        "dflash_eval.demo.drafters",
        "add_arguments",
        "run",
        "train the demo's DFlash drafters and save checkpoints",
    ),
    "demo-server": (
        "dflash_eval.demo.server",
        "add_arguments",
        "run",
        "serve the demo target over SGLang 0.5.23's HTTP protocol, speculating with a DFlash drafter",
    ),
    "server": ("dflash_eval.server.control", "add_arguments", "run", "start, stop or query the inference server"),
    "fetch": ("dflash_eval.fetch.stage", "add_arguments", "run", "fetch greedy completions from the server"),
    "extract": ("dflash_eval.extract.stage", "add_arguments", "run", "extract the target's hidden states"),
    "profile-target": (
        "dflash_eval.tools.profile_target",
        "add_arguments",
        "run",
        "time the target's serving step once (T_AR, T_verify(n)) for the expected speedup",
    ),
    "compare-backends": (
        "dflash_eval.tools.compare_backends",
        "add_arguments",
        "run",
        "per-layer differences between the fla and torch kernels, and their effect on tau",
    ),
    "evaluate": ("dflash_eval.evaluate.command", "add_arguments", "run", "evaluate one drafter on one dataset"),
    "gpu-placements": (
        "dflash_eval.evaluate.placement",
        "add_arguments",
        "run",
        "check the GPU claims evaluations recorded: which job ran on which GPU, none two at once",
    ),
    "profile-server": (
        "dflash_eval.tools.profile_server",
        "add_arguments",
        "run",
        "measure T_AR and T_step at forced acceptance lengths on the managed SGLang server",
    ),
    "report": ("dflash_eval.report.stage", "add_arguments", "run", "summary tables and plots"),
    "export": (
        "dflash_eval.report.export",
        "add_arguments",
        "run",
        "one evaluation's speculation profile and reproducible record, beside its metrics.json",
    ),
    "status": (
        "dflash_eval.provenance.status",
        "add_arguments",
        "run",
        "name the outputs that older code made, from their stamps (one line)",
    ),
}
