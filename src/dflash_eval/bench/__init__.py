"""The old name of dflash_eval.testing, for the two modules that still import it (tests/workflow/test_reruns.py,
benchmarks/fidelity_sampled.py). Delete this package once they import dflash_eval.testing and tests.support."""
