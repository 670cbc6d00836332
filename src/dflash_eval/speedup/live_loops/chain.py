"""The chain loop: per block size b three steps (draft, verify, accept), each a captured graph on CUDA;
rollback by position only, so pure-attention targets only. The steps and the last block's rule:
docs/speedup_loops.md."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash_eval.speedup.forwards.drafter import StaticDrafter
from dflash_eval.speedup.forwards.graphs import capture
from dflash_eval.speedup.forwards.target import StaticTarget
from dflash_eval.speedup.live_loops.run import LoopRun
from dflash_eval.speedup.simulate import simulated_length
from dflash_eval.speedup.timing import timed_ms


@dataclass(frozen=True)
class StaticRun(LoopRun):
    """A LoopRun (per-step committed lengths) with the ids it produced."""

    output_ids: torch.Tensor


class StaticLoop:
    """The loop for one target (pure attention) and one DFlash drafter, at the block sizes `blocks` (and 1),
    for sequences of up to `max_len` tokens. `graphs`: capture each step as a CUDA graph (CUDA only)."""

    def __init__(
        self, target: torch.nn.Module, drafter: torch.nn.Module | None, max_len: int, blocks: list[int], graphs: bool
    ):
        self.blocks = sorted({1} | {int(b) for b in blocks})
        # a full last block and its bonus fit past max_len; a multiple of 64 keeps the masks aligned for SDPA's kernels
        width = -(-(int(max_len) + 2 * max(self.blocks) + 1) // 64) * 64
        self.max_len = int(max_len)
        with torch.inference_mode():
            layer_ids = list(drafter.target_layer_ids) if drafter is not None else []
            self.target = self._static_target(target, width, layer_ids)
            self.drafter = (
                None
                if drafter is None
                else StaticDrafter(
                    drafter,
                    target.get_input_embeddings().weight,
                    lambda hidden: drafter.compute_logits(hidden, target.lm_head),
                    width,
                )
            )  # dflash's class
            device = self.target.device
            self.device = device
            self.mask_id = -1 if drafter is None else int(drafter.mask_token_id)
            long = dict(device=device, dtype=torch.long)
            self.start, self.ctx_start = torch.zeros(1, **long), torch.zeros(1, **long)
            self.sim, self.acc = torch.zeros(1, **long), torch.zeros(1, **long)
            self.out = torch.full((width + max(self.blocks) + 1,), max(self.mask_id, 0), **long)
            vocab = int(target.get_input_embeddings().weight.shape[0])
            self.ids = {b: torch.zeros(1, b, **long) for b in self.blocks}
            self.logits = {b: torch.zeros(b, vocab, device=device, dtype=self.target.dtype) for b in self.blocks}
            feature_width = len(layer_ids) * int(target.config.hidden_size)
            self.features = {
                b: torch.zeros(b, feature_width, device=device, dtype=self.target.dtype) for b in self.blocks if b > 1
            }
        self.graphs = bool(graphs) and device.type == "cuda"
        self.steps: dict[tuple[str, int], Callable[[], None]] = {}
        for b in self.blocks:
            if b > 1 and self.drafter is None:
                raise ValueError(f"block {b} needs a drafter")
            self.steps[("verify", b)] = self._capture(lambda b=b: self._verify(b))
            self.steps[("accept", b)] = self._capture(lambda b=b: self._accept(b))
            if b > 1:
                self.steps[("draft", b)] = self._capture(lambda b=b: self._draft(b))

    def _static_target(self, model: torch.nn.Module, width: int, layer_ids: list[int]) -> StaticTarget:
        """The target over static caches of `width` positions (live_loops/hybrid.py runs a hybrid's)."""
        return StaticTarget(model, width, layer_ids)

    # the three steps, on static buffers only (no host read: capturable)
    def _verify(self, b: int) -> None:
        logits, features = self.target.forward(self.ids[b], self.start, features=b > 1)
        self.logits[b].copy_(logits)
        if features is not None:
            self.features[b].copy_(features)

    def _draft(self, b: int) -> None:
        drafts = self.drafter.draft(self.features[b], self.ctx_start, self.ids[b][0, :1], self.start, b)
        self.ids[b][0, 1:].copy_(drafts)

    def _accept(self, b: int) -> None:
        logits, block, start = self.logits[b], self.ids[b][0], self.start
        if b > 1:
            posterior = logits.argmax(-1)
            real = (block[1:] == posterior[:-1]).to(torch.long).cumprod(0).sum().view(1)
            acc = torch.where(self.sim > 0, self.sim - 1, real)
            row = logits.index_select(0, acc)[0]
            rejected = block.index_select(0, (acc + 1).clamp(max=b - 1))  # draft acc + 1: never the bonus
            excluded = (torch.arange(row.shape[0], device=self.device) == rejected) & (acc + 1 < b)
            bonus = row.masked_fill(excluded, torch.finfo(row.dtype).min).argmax(-1).view(1)
        else:
            acc, bonus = torch.zeros_like(start), logits[0].argmax(-1).view(1)
        offsets = torch.arange(b + 1, device=self.device)
        values = torch.where(offsets <= acc, torch.cat([block, bonus]), bonus)
        self.out.index_copy_(0, start + offsets, values)
        self.acc.copy_(acc)
        self.ctx_start.copy_(start)
        self.start.add_(acc + 1)
        block[:1].copy_(bonus)

    def _capture(self, step: Callable[[], None]) -> Callable[[], None]:
        return capture(step, self.device, self.graphs, reset=self.start.zero_)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, block: int) -> int:
        """Eager, untimed: the prompt's forward, its greedy next token, the drafter's context; returns its length."""
        n = int(prompt.shape[1])
        if n + 1 > self.max_len:
            raise ValueError(f"a prompt of {n} tokens does not fit a loop of max_len {self.max_len}")
        with torch.inference_mode():
            zero = torch.zeros(1, dtype=torch.long, device=self.device)
            logits, features = self.target.forward(prompt, zero, features=block > 1)
            first = logits[-1].argmax(-1)
            self.out.fill_(max(self.mask_id, 0))
            self.out[:n].copy_(prompt[0])
            self.out[n] = first
            self.start.fill_(n)
            self.ids[block][0, 0] = first
            if block > 1:
                self.drafter.context(features, zero)
                low = max(0, n - block)  # the first draft re-projects the last rows (the shape it is captured at)
                self.features[block].zero_()
                self.features[block][: n - low].copy_(features[low:])
                self.ctx_start.fill_(low)
        return n

    @torch.inference_mode()
    def generate(
        self, prompt: torch.Tensor, max_new_tokens: int, block: int, simulate_tau: float | None = None, seed: int = 0
    ) -> StaticRun:
        """Greedy generation of `max_new_tokens` tokens at `block` (1: autoregressive), acceptance simulated at
        `simulate_tau` when given (one draw per step, as speedup/simulate.py's forced_acceptance draws)."""
        if block not in self.blocks:
            raise ValueError(f"block {block} was not captured (blocks {self.blocks})")
        n = self.prefill(prompt, block)
        max_length = n + int(max_new_tokens)
        if max_length + 1 > self.max_len:
            raise ValueError(f"{n} + {max_new_tokens} tokens do not fit a loop of max_len {self.max_len}")
        rng = random.Random(seed)
        draft, verify, accept = (
            self.steps.get(("draft", block)),
            self.steps[("verify", block)],
            self.steps[("accept", block)],
        )
        lengths: list[int] = []
        start = n
        self._sync()
        began = time.perf_counter()
        while start + 1 < max_length:
            if block > 1:
                self.sim.fill_(simulated_length(simulate_tau, block, rng) if simulate_tau is not None else 0)
                draft()
            verify()
            accept()
            produced = min(int(self.acc.item()) + 1, max_length - start - 1)  # the step's one host sync
            start += produced
            lengths.append(produced)
        self._sync()
        decode_s = time.perf_counter() - began
        return StaticRun(decode_s, start + 1 - n, lengths, self.out[: start + 1].clone()[None].cpu())

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def step_terms(self, block: int, repeats: int, budget_s: float = 1.0, at: int | None = None) -> dict[str, dict]:
        """The per-step terms this loop pays at `block`, each timed alone (timing.timed_ms: synchronised repeats
        until the median's 95% CI is within ±2%): `verify`, `draft` (b > 1), and `accept_host` (the accept
        step, its launch and the host read of the accepted length: the host round trip a step pays)."""
        position = self.max_len // 2 if at is None else int(at)

        def reset() -> None:
            self.start.fill_(position)
            self.ctx_start.fill_(max(0, position - block))
            self.sim.fill_(0)

        reset()
        terms = {
            "verify": timed_ms(self.steps[("verify", block)], self.device, repeats, setup=reset, budget_s=budget_s)
        }
        if block > 1:
            terms["draft"] = timed_ms(
                self.steps[("draft", block)], self.device, repeats, setup=reset, budget_s=budget_s
            )
        accept = self.steps[("accept", block)]
        terms["accept_host"] = timed_ms(
            lambda: (accept(), int(self.acc.item())), self.device, repeats, setup=reset, budget_s=budget_s
        )
        return terms
