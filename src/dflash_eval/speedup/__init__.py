"""The expected-speedup feature's shared parts, below the stages that use them.

- model.py: expected speedup = tau x T_AR / (T_draft + T_verify(n)) from a profile, per method;
- timing.py: how a step is timed (median of synchronised repeats) and when timing is wanted;
- labels.py: the formula and source labels the report writes and shows;
- simulate.py: SGLang's simulated acceptance (SGLANG_SIMULATE_ACC_LEN) for the live loops;
- static_models.py, static_loop.py: a speculative loop that runs like a server (static KV caches, CUDA graphs,
  acceptance on the device), pure-attention targets; what benchmarks/speedup_validation.py measures against.

Where each stage meets it: the profile_target rule times the target (tools/target_timing.py, writing the file
whose format cache/serving_profile.py checks, one per target, device, dtype and backend), evaluation times the
drafter (evaluate/draft_timing.py, evaluate/speedup.py), and the report makes the estimate from the two and tau
and labels it (report/speedup.py).
"""
