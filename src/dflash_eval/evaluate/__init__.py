"""Stage 3: a drafter's acceptance (chain and DDTree) from the cached states."""
