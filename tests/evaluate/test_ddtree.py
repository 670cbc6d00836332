"""DDTree acceptance: hand-computed trees and the vectorised form against a literal heap build."""


import pytest
import torch

from dflash_eval.evaluate.ddtree import tree_accepted

from tests.support.reference import heap_tree


def _logits(rows):
    """Logits whose log-softmax equals log(rows) (rows are probabilities)."""
    return torch.tensor(rows, dtype=torch.float32).log()[None]


def test_hand_computed_tree():
    # position 1: token 0 p=.5, token 1 p=.3, token 2 p=.2; position 2: token 1 p=.9, token 3 p=.1 (other .0)
    probs = [[0.5, 0.3, 0.2, 1e-9], [1e-9, 0.9, 1e-9, 0.1]]
    # best-first scores: (0) .5, (0,1) .45, (1) .3, (1,1) .27, (2) .2, (2,1) .18, (0,3) .05 ...
    truth = torch.tensor([[1, 1]])
    got = tree_accepted(_logits(probs), truth, [1, 2, 3, 4, 6]).flatten().tolist()
    # truth path (1) is the 3rd node, (1,1) the 4th
    assert got == [0, 0, 1, 2, 2]


def test_truth_outside_the_top_n_stops_the_path():
    probs = [[0.6, 0.4, 1e-9, 1e-9], [0.25, 0.25, 0.25, 0.25]]
    assert tree_accepted(_logits(probs), torch.tensor([[2, 0]]), [1, 2, 8]).flatten().tolist() == [0, 0, 0]
    assert tree_accepted(_logits(probs), torch.tensor([[0, -1]]), [8]).flatten().tolist() == [1]  # past the end


@pytest.mark.parametrize("seed", range(30))
def test_vectorised_equals_heap_built_tree(seed):
    generator = torch.Generator().manual_seed(seed)
    m, positions, vocab = 5, 1 + seed % 6, 12
    logits = torch.randn(m, positions, vocab, generator=generator) * (0.5 + seed % 4)
    budgets = [1, 2, 5, 9, 16]
    truth = torch.where(torch.rand(m, positions, generator=generator) < 0.7,
                        logits.argmax(-1), torch.randint(0, vocab, (m, positions), generator=generator))
    got = tree_accepted(logits, truth, budgets)
    for row, budget in enumerate(budgets):
        for anchor in range(m):
            tree = heap_tree(torch.log_softmax(logits[anchor], -1), budget)
            depth = 0
            while depth < positions and tuple(truth[anchor, :depth + 1].tolist()) in tree:
                depth += 1
            assert got[row, anchor].item() == depth, (seed, budget, anchor)
