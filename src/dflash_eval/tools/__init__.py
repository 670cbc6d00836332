"""Commands beside the pipeline (kernel comparisons)."""
