"""The expected-speedup feature's shared parts, below the stages that use them.

- model.py: expected speedup = tau x T_AR / (T_draft + T_verify(n)) from a profile, per method;
- timing.py: how a step is timed (median of synchronised repeats) and when timing is wanted;
- labels.py: the formula and source labels the evaluation writes and the report shows;
- simulate.py: SGLang's simulated acceptance (SGLANG_SIMULATE_ACC_LEN) for the live loops;
- static_models.py, static_loop.py: a speculative loop that runs like a server (static KV caches, CUDA graphs,
  acceptance on the device), pure-attention targets; what benchmarks/speedup_validation.py measures against.

Where each stage meets it: extraction times the target (extract/profile.py, writing the file whose format
cache/serving_profile.py checks, beside the cache), evaluation times the drafter (evaluate/draft_timing.py)
and estimates (evaluate/speedup.py), the report reads metrics.json and labels it (report/).
"""
