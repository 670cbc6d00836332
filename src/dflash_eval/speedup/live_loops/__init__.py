"""The live loops benchmarks/speedup_validation.py measures the expected speedup against: speculative decoding
run like a server (static caches, CUDA graphs, greedy acceptance on the device). No stage runs them: they sit
outside every stage's declared code (provenance/identity.py)."""
