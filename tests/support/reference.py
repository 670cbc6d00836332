"""Near-tie forensics and a literal DDTree loop beside the reference loop
(dflash_eval.demo.reference): the tests' side of the offline-equals-reference-loop checks."""

from __future__ import annotations

import torch

from dflash_eval.demo.reference import first_difference, top2_gap


def _greedy_next(target, ids: list[int]) -> int:
    with torch.no_grad():
        return int(target(torch.tensor([ids])).logits[0, -1].argmax())


def _draft_logprobs(drafter, target, ids: list[int], start: int, size: int) -> torch.Tensor:
    """The reference drafter's block at anchor `start`, recomputed from scratch: [size - 1, V] log-probs."""
    from dflash.model import _output_head, extract_context_feature

    with torch.no_grad():
        hidden = target(torch.tensor([ids[:start]]), output_hidden_states=True).hidden_states
        context = extract_context_feature(hidden, drafter.target_layer_ids)
        block = torch.tensor([[ids[start]] + [drafter.mask_token_id] * (size - 1)])
        scale = float(getattr(drafter.config, "input_embedding_scale", 1.0))
        noise = torch.nn.functional.embedding(block, target.get_input_embeddings().weight) * scale
        out = drafter(position_ids=torch.arange(start + size)[None], noise_embedding=noise, target_hidden=context)
        logits = drafter.compute_logits(out[:, 1:], _output_head(target))[0]
    return torch.log_softmax(logits.float(), dim=-1)


def best_first(values: torch.Tensor, count: int):
    """The first `count` DDTree nodes popped best-first, as (rank path, score), built literally with a heap:
    pop the best, push its next sibling and its first child. values [P, W]: per-position top-W log-probs."""
    import heapq

    width, depth_max = values.shape[1], values.shape[0]

    def score(ranks: tuple[int, ...]) -> float:
        total = torch.zeros((), dtype=values.dtype)
        for depth, rank in enumerate(ranks):
            total = total + values[depth, rank]
        return float(total)

    heap = [(-score((0,)), (0,))]
    popped: list[tuple[tuple[int, ...], float]] = []
    while heap and len(popped) < count:
        negative, ranks = heapq.heappop(heap)
        popped.append((ranks, -negative))
        if ranks[-1] + 1 < width:
            sibling = ranks[:-1] + (ranks[-1] + 1,)
            heapq.heappush(heap, (-score(sibling), sibling))
        if len(ranks) < depth_max:
            child = ranks + (0,)
            heapq.heappush(heap, (-score(child), child))
    return popped


def heap_tree(logprobs: torch.Tensor, budget: int) -> set[tuple[int, ...]]:
    """DDTree-N as token paths: the first N best-first nodes of the per-position top-N."""
    values, indices = torch.topk(logprobs, min(budget, logprobs.shape[-1]), dim=-1)
    return {tuple(int(indices[d, r]) for d, r in enumerate(ranks)) for ranks, _ in best_first(values, budget)}


def ddtree_reference_loop(
    drafter, target, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int], budget: int
) -> tuple[list[int], list[int]]:
    """A straightforward DDTree loop with the live target: build each tree, walk it with the target's
    greedy choices, accept the deepest matching path plus the bonus token. Returns (lengths, ids)."""
    ids = list(prompt_ids)
    max_length = len(ids) + max_new_tokens
    ids.append(_greedy_next(target, ids))
    start, lengths, stopped = len(prompt_ids), [], ids[-1] in stop_ids
    while start + 1 < max_length and not stopped:
        size = min(drafter.block_size, max_length - start)
        tree = heap_tree(_draft_logprobs(drafter, target, ids, start, size), budget) if size > 1 else set()
        path: tuple[int, ...] = ()
        while True:
            nxt = _greedy_next(target, ids[: start + 1] + list(path))
            if path + (nxt,) in tree:
                path += (nxt,)
            else:
                break
        produced_ids = list(path) + [nxt]
        produced = min(len(produced_ids), max_length - start - 1)
        for offset, token in enumerate(produced_ids[:produced], 1):
            if token in stop_ids:
                produced, stopped = offset, True
                break
        ids = ids[: start + 1] + produced_ids[:produced]
        start += produced
        lengths.append(produced)
    return lengths, ids[: min(start + 1, max_length)]


def chain_tie_gap(logprobs: torch.Tensor, truth: list[int], accepted: tuple[int, int]) -> float:
    """Top-2 gap of the draft position where two chain acceptances part ways."""
    return top2_gap(logprobs[min(accepted)])


def tree_tie_gap(logprobs: torch.Tensor, truth: list[int], budget: int) -> float:
    """Smallest score gap between a truth-path node and any other node of the best-first order.

    Two DDTree acceptances at the same anchor can differ only if the truth path's node and the
    budget-th node swap places, i.e. their scores (sums of log-probs) nearly tie.
    """
    values, indices = torch.topk(logprobs, min(budget + 1, logprobs.shape[-1]), dim=-1)
    truth_scores, total = [], torch.zeros((), dtype=values.dtype)
    for depth, token in enumerate(truth[: values.shape[0]]):
        hit = (indices[depth] == token).nonzero()
        if len(hit) == 0:
            break
        total = total + values[depth, int(hit[0])]
        truth_scores.append(float(total))
    others = [score for _, score in best_first(values, budget + 1)]
    gaps = [abs(t - o) for t in truth_scores for o in others if t != o]
    return min(gaps) if gaps else float("inf")


def assert_same_steps(
    mine: list[int],
    ref_steps: list[int],
    ref_ids: list[int],
    expected_ids: list[int],
    prompt_len: int,
    target,
    tie: float = 1e-4,
    draft_logprobs=None,
    budget: int | None = None,
) -> int:
    """Offline steps must equal the live loop's, step by step, or differ only at a near-tie.

    Two kinds of floating-point near-tie are allowed, both shown, never assumed: the live loop's
    own tokens leave the expected greedy completion at a target near-tie (top-2 logit gap < `tie`:
    a cached block forward rounds differently from a whole-sequence one), or
    the drafter's acceptance differs at an anchor where the draft itself nearly ties (its context
    features come from those differently rounded verify forwards in the reference loop). `draft_logprobs(anchor)`
    gives the drafter's block log-probs [P, V] there; `budget` says the steps are DDTree ones.
    Steps are compared up to the first such tie. Returns the number of steps compared.
    """
    diverge = first_difference(ref_ids, expected_ids)
    if diverge is not None:
        with torch.no_grad():
            logits = target(torch.tensor([expected_ids[:diverge]])).logits[0, -1]
        gap = top2_gap(logits)
        assert gap < tie, f"live loop left the greedy completion at token {diverge} without a near-tie (gap {gap:.3g})"
    else:
        diverge = len(expected_ids) + 1
    start, compared, tied = prompt_len, 0, False
    for a, b in zip(mine, ref_steps):
        if start + max(a, b) >= diverge:
            break
        if a != b:
            tied = True
            assert draft_logprobs is not None, (compared, mine, ref_steps)
            logprobs = draft_logprobs(start)
            truth = expected_ids[start + 1 : start + 1 + logprobs.shape[0]]
            gap = tree_tie_gap(logprobs, truth, budget) if budget else chain_tie_gap(logprobs, truth, (a - 1, b - 1))
            assert gap < tie, (
                f"step {compared} at anchor {start}: {a} offline vs {b} in the reference loop, no near-tie (gap {gap:.3g})"
            )
            break
        start, compared = start + a, compared + 1
    if diverge > len(expected_ids) and not tied:
        assert len(mine) == len(ref_steps), (mine, ref_steps)
    return compared


def assert_autoregressive_is_greedy(loop, target, prompt: torch.Tensor, new_tokens: int = 20) -> None:
    """A static loop at block 1 (its autoregressive baseline) gives the HF target's own greedy output, one token a
    step: the reference is `target.generate`."""
    run = loop.generate(prompt, new_tokens, 1)
    with torch.no_grad():
        greedy = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    assert run.acceptance_lengths == [1] * (new_tokens - 1)
    assert torch.equal(run.output_ids, greedy)


def dflash_reference(
    drafter,
    target,
    prompt: torch.Tensor,
    new_tokens: int,
    block: int,
    tau: float | None,
    seed: int,
    exact_rollback: bool = False,
):
    """dflash's own `dflash_generate` (return_stats), greedy or with acceptance forced at `tau` as SGLang's
    SGLANG_SIMULATE_ACC_LEN does; `exact_rollback` for a Gated DeltaNet hybrid (demo/reference.py: transformers'
    crop keeps rejected tokens in the GDN states). The reference the static loops are held to."""
    import contextlib

    import dflash.model as reference

    from dflash_eval.demo.live_loop import _host_clock_on_cpu
    from dflash_eval.demo.reference import exact_target_rollback
    from dflash_eval.speedup.simulate import forced_acceptance

    with contextlib.ExitStack() as stack:
        if exact_rollback:
            stack.enter_context(exact_target_rollback(target))
        stack.enter_context(_host_clock_on_cpu(prompt.device))
        if tau is not None:
            stack.enter_context(forced_acceptance(target, tau, seed=seed))
        return reference.dflash_generate(drafter, target, prompt, new_tokens, None, block_size=block, return_stats=True)
