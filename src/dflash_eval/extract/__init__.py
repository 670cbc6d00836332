"""Stage 2: the target's hidden states at the drafter's layers, with an explicit kernel backend."""
