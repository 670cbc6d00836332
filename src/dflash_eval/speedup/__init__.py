"""The expected-speedup feature, in rooms by role.

- the estimate: model.py (expected speedup = tau x T_AR / (T_draft + T_verify(n)) from a profile, per method) and
  labels.py (the formula and source labels the report shows); timing.py: how a step is timed;
- forwards/: the forwards the product times, each capturable as a CUDA graph (target, hybrid target, drafter, a
  DDTree step's tree); simulate.py: SGLang's simulated acceptance (SGLANG_SIMULATE_ACC_LEN);
- live_loops/: the loops benchmarks/speedup_validation.py measures the estimate against, outside every stage's
  declared code; validation.py: what they found, shipped as a record the report quotes.

Where each stage meets it: the profile_target rule times the target (tools/target_timing.py, the file format in
cache/serving_profile.py), evaluation times the drafter (evaluate/draft_timing.py, evaluate/speedup.py), and the
report makes the estimate (report/speedup.py).
"""
