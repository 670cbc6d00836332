"""The truth node never outranks itself: its score is summed as the beam sums it, bit for bit.

The greedy path of a confident drafter has only its own ancestors above it, so with a budget of one
node per depth every depth is in the tree. When the truth path's score was a cumsum (accumulated in
double on the CPU) and the beam's a chain of float additions, the two differed in the last bit for
some rows, the truth node counted as better than itself, and the tree lost its deepest node.
"""

import torch

from dflash_eval.evaluate.ddtree import tree_accepted


def test_greedy_path_of_a_confident_drafter_fills_a_one_node_per_depth_tree():
    generator = torch.Generator().manual_seed(0)
    rows, positions, vocab = 400, 15, 50
    logits = torch.randn(rows, positions, vocab, generator=generator)
    truth = logits.argmax(dim=-1)
    # a clear winner everywhere, with log-probs of varied size so that roundings differ
    logits.scatter_(-1, truth[..., None], 12.0 + 8.0 * torch.rand(rows, positions, 1, generator=generator))
    accepted = tree_accepted(logits, truth, [positions])[0]
    assert (accepted == positions).all(), f"{int((accepted < positions).sum())} rows lost their deepest node"
