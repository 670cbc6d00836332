"""The all-anchor drafter forward equals the reference model's own forward, anchor by anchor."""

import pytest
import torch

from dflash_eval.evaluate.blocks import BlockDrafter
from tests.support.tiny import MASK_ID, tiny_drafter, tiny_target


def _features(target, tokens, layer_ids):
    with torch.no_grad():
        out = target(tokens[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("window", [None, 3, 5])
@pytest.mark.parametrize("block_size", [4, 6])
def test_block_logits_equal_reference_forward(window, block_size, dflash2):
    target = tiny_target()
    layer_ids = [0, 2]
    drafter = tiny_drafter(layer_ids, window=window, block_size=block_size, dflash2=dflash2)
    tokens = torch.randint(2, 290, (24,), generator=torch.Generator().manual_seed(3))
    features = _features(target, tokens, layer_ids)
    embed = target.model.embed_tokens.weight.detach()
    head = target.lm_head.weight.detach()
    runner = BlockDrafter(drafter, embed, head, MASK_ID)
    anchors = torch.arange(5, 20)
    with torch.no_grad():
        ours = runner.logits(runner.block_hidden(runner.context(features), tokens, anchors))
        for row, s in enumerate(anchors.tolist()):
            block = torch.full((1, block_size), MASK_ID)
            block[0, 0] = tokens[s]
            hidden = drafter(
                target_hidden=features[None, :s],
                noise_embedding=torch.nn.functional.embedding(block, embed),
                position_ids=torch.arange(s + block_size)[None],
            )[:, 1:]
            reference = drafter.compute_logits(hidden, target.lm_head)[0]
            torch.testing.assert_close(ours[row], reference, atol=2e-5, rtol=1e-5)


def test_dflash2_draft_is_the_candidate_selectors_path_not_the_argmax():
    """draft_tokens equals the reference's own `propose` at temperature 0, anchor by anchor."""
    target = tiny_target()
    drafter = tiny_drafter([0, 2], dflash2=True, block_size=6)
    with torch.no_grad():
        for param in drafter.candidate_selector.parameters():
            param.normal_(0, 1.0)  # a selector strong enough to overrule the argmax somewhere
    tokens = torch.randint(2, 290, (24,), generator=torch.Generator().manual_seed(3))
    features = _features(target, tokens, [0, 2])
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    runner = BlockDrafter(drafter, embed, head, MASK_ID)
    anchors = torch.arange(5, 20)
    with torch.no_grad():
        hidden = runner.block_hidden(runner.context(features), tokens, anchors)
        logits = runner.logits(hidden)
        ours = runner.draft_tokens(hidden, logits, tokens[anchors])
        for row, s in enumerate(anchors.tolist()):
            block = torch.full((1, 6), MASK_ID)
            block[0, 0] = tokens[s]
            draft_hidden = drafter(
                target_hidden=features[None, :s],
                noise_embedding=torch.nn.functional.embedding(block, embed),
                position_ids=torch.arange(s + 6)[None],
            )[:, 1:]
            reference = drafter.propose(draft_hidden, tokens[s : s + 1], target.lm_head, 0.0)[0][0]
            assert torch.equal(ours[row], reference), (s, ours[row], reference)
    assert not torch.equal(ours, logits.argmax(dim=-1)), "the selector never changed the draft: test too weak"


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"output_multiplier": 0.5},
        {"final_logit_softcapping": 3.0},
        {"output_multiplier": 2.5, "final_logit_softcapping": 30.0},
    ],
    ids=["plain", "multiplier", "softcap", "both"],
)
@pytest.mark.parametrize("where", ["dflash_config", "config"])
def test_head_logits_equal_compute_logits_bit_for_bit(settings, where):
    """The head mirrors the model's compute_logits (read from either place dflash reads it), exactly."""
    target = tiny_target()
    drafter = tiny_drafter([0, 2])
    for name, value in settings.items():
        if where == "dflash_config":
            drafter.config.dflash_config[name] = value
        else:
            setattr(drafter.config, name, value)
    runner = BlockDrafter(drafter, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), MASK_ID)
    states = torch.randn(5, 3, drafter.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 4
    with torch.no_grad():
        reference = drafter.compute_logits(states, target.lm_head)
        ours = runner.head_logits(states.contiguous())
    assert torch.equal(ours, reference)
    if settings:
        plain = torch.nn.functional.linear(states, target.lm_head.weight)
        assert not torch.equal(ours, plain), "the setting must change the logits for the test to mean anything"
