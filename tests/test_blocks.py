"""The all-anchor drafter forward equals the reference model's own forward, anchor by anchor."""

import pytest
import torch

from dflash_eval.blocks import BlockDrafter

from tiny import MASK_ID, tiny_drafter, tiny_target


def _features(target, tokens, layer_ids):
    with torch.no_grad():
        out = target(tokens[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)


@pytest.mark.parametrize("window", [None, 3, 5])
@pytest.mark.parametrize("block_size", [4, 6])
def test_block_logits_equal_reference_forward(window, block_size):
    target = tiny_target()
    layer_ids = [0, 2]
    drafter = tiny_drafter(layer_ids, window=window, block_size=block_size)
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
                target_hidden=features[None, :s], noise_embedding=torch.nn.functional.embedding(block, embed),
                position_ids=torch.arange(s + block_size)[None],
            )[:, 1:]
            reference = drafter.compute_logits(hidden, target.lm_head)[0]
            torch.testing.assert_close(ours[row], reference, atol=2e-5, rtol=1e-5)
