"""Tiny drafters and token sequences on which their chains are accepted at tau ~3.5: the cases the trajectory
evaluator's tests (tests/evaluate/test_trajectory.py, test_cuda_graphs.py) run every evaluator on."""

import torch

from dflash_eval.evaluate.acceptance import sequence_limits
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.trajectory import LoadedSample, SampleSpec
from dflash_eval.testing.accepted import accepted_tokens
from tests.support.tiny import MASK_ID, tiny_drafter, tiny_target

LAYERS = [0, 2]
BLOCK = 6
BUDGETS = [2, 3, 6]
TOPK = [1, 3]
STOPS = {1, 7}


def runner(dflash2=False, window=5, dtype=torch.float32):
    target = tiny_target(seed=0)  # only its embedding and LM head
    drafter = tiny_drafter(LAYERS, block_size=BLOCK, window=window, dflash2=dflash2)
    if dflash2:
        with torch.no_grad():  # a selector that overrules the argmax somewhere
            for param in drafter.candidate_selector.parameters():
                param.normal_(0, 0.5)
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    return BlockDrafter(drafter, embed, head, MASK_ID).to(dtype)


def sequences(runner, count=9, seed=1, dtype=torch.float32):
    """Sequences on which the drafter's chain is accepted at tau ~3.5, some ending on a stop token, one
    with a stop token inside, most with a token budget shorter than what could follow."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [18 + 6 * i for i in range(count)]
    prompts = [4 + i for i in range(count)]
    features = [torch.randn(n, 2 * 64, generator=generator).to(dtype) for n in lengths]
    out = []
    for i, tokens in enumerate(accepted_tokens(runner, features, prompts, tau=3.5, seed=seed)):
        if i % 2:
            tokens[-1] = 1
        if i == 4:
            tokens[prompts[i] + 5] = 7  # a stop token inside the completion
        budget = None if i % 3 == 0 else lengths[i] - prompts[i] - 2 - i % 2 * 2
        limits = sequence_limits(prompts[i], lengths[i], budget, int(tokens[-1]) in STOPS)
        out.append((str(i), features[i], tokens, limits))
    return out


def specs(sequences):
    return [
        SampleSpec(key, len(tokens), lambda f=features, t=tokens, lim=limits: LoadedSample(f, t, lim))
        for key, features, tokens, limits in sequences
    ]
