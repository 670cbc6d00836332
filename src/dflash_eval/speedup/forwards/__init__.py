"""The forwards the product times, each capturable as a CUDA graph: the target (pure attention, or a Gated
DeltaNet hybrid) and the DFlash drafter over preallocated KV caches, a DDTree step's tree, and the graph capture.
tools/target_timing.py and evaluate/draft_timing.py time them; the live loops (speedup/live_loops/) run them."""
