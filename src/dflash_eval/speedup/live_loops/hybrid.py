"""The chain loop (live_loops/chain.py) for a Gated DeltaNet hybrid target (forwards/hybrid_target.py)."""

from __future__ import annotations

import torch

from dflash_eval.speedup.forwards.hybrid_target import (
    GdnKernels,
    StaticHybridTarget,
)
from dflash_eval.speedup.live_loops.chain import StaticLoop
from dflash_eval.speedup.timing import timed_ms


class StaticHybridLoop(StaticLoop):
    """StaticLoop for a Gated DeltaNet hybrid target (StaticHybridTarget) and one DFlash drafter: the same steps
    and API (`generate`, `step_terms`), except that the verify of a block b > 1 leaves the GDN states as they
    were (its snapshot) and the captured accept step commits the accepted tokens to them (`keep`). Block 1 (the
    autoregressive baseline) commits in its verify, as a server's decode step does."""

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: torch.nn.Module | None,
        max_len: int,
        blocks: list[int],
        graphs: bool,
        kernels: GdnKernels,
    ):
        self.kernels = kernels
        super().__init__(target, drafter, max_len, blocks, graphs)
        for b in self.blocks:
            if b > 1:  # the rollback alone, for step_terms
                self.steps[("keep", b)] = self._capture(lambda b=b: self.target.keep(self.acc + 1, b))

    def _static_target(self, model: torch.nn.Module, width: int, layer_ids: list[int]) -> StaticHybridTarget:
        """The hybrid over static caches and states, each block's verify record made before any capture."""
        static = StaticHybridTarget(model, width, self.kernels, layer_ids)
        for b in self.blocks:
            if b > 1:
                static.prepare(b)
        return static

    def _verify(self, b: int) -> None:
        logits, features = self.target.forward(self.ids[b], self.start, features=b > 1, commit=b == 1)
        self.logits[b].copy_(logits)
        if features is not None:
            self.features[b].copy_(features)

    def _accept(self, b: int) -> None:
        super()._accept(b)
        if b > 1:  # the bonus and the acc accepted drafts are the block's kept tokens
            self.target.keep(self.acc + 1, b)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, block: int) -> int:
        """StaticLoop's prefill from empty GDN states (the captures and the last sequence left theirs)."""
        self.target.reset()
        return super().prefill(prompt, block)

    @torch.inference_mode()
    def step_terms(self, block: int, repeats: int, budget_s: float = 1.0, at: int | None = None) -> dict[str, dict]:
        """StaticLoop's terms (`accept_host` includes the GDN rollback, as the loop pays it), and for b > 1
        `rollback`: the GDN replay and conv gather alone (what a verify of a hybrid costs beyond its forward)."""
        terms = super().step_terms(block, repeats, budget_s, at)
        if block > 1:
            position = self.max_len // 2 if at is None else int(at)

            def reset() -> None:
                self.start.fill_(position)
                self.acc.fill_(block - 1)

            terms["rollback"] = timed_ms(
                self.steps[("keep", block)], self.device, repeats, setup=reset, budget_s=budget_s
            )
        return terms
