"""Stage 1: greedy completions from a live server, with the prompt sets they answer."""
