"""One timed generation of a live loop, as the speedup benchmarks measure it (the eager and the static loop)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoopRun:
    """One timed generation: its decode seconds, the tokens it produced after the prefill's, its steps."""

    decode_s: float
    new_tokens: int
    acceptance_lengths: list[int]

    @property
    def tau(self) -> float:
        """Token-weighted (tokens / steps, the bonus included): what throughput counts."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.decode_s / len(self.acceptance_lengths)
