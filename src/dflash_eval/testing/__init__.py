"""What the tests and the benchmarks share, as `torch.testing` is for torch: synthetic inputs (token sequences
accepted at a chosen rate, a character-level tokenizer, prompts, tiny projects), a fake OpenAI server, a Snakemake
runner with a recording `dflash-eval`, and reference implementations the optimised code is checked against.

It ships in the wheel and works from it: nothing here finds files relative to a checkout; a caller that copies the
workflow names the directory it comes from. Helpers that need the checkout live in tests/support/."""
