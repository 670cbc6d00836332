"""DDTree acceptance: hand-computed trees and the vectorised form against a literal heap build."""

from itertools import product

import pytest
import torch

from dflash_eval.evaluate import ddtree
from dflash_eval.testing.ddtree_beam import beam_tree_accepted
from tests.support.reference import heap_tree

HOST_READS = [True]


@pytest.fixture(autouse=True, params=[True, False], ids=["host-reads", "on-device"])
def _scorer_mode(request):
    """Every test here runs the scorer both ways: with its per-depth host reads, and without any (issue 30's lever)."""
    HOST_READS[0] = request.param
    yield
    HOST_READS[0] = True


def tree_accepted(logits, truth, budgets):
    return ddtree.tree_accepted(logits, truth, budgets, host_reads=HOST_READS[0])


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
    truth = torch.where(
        torch.rand(m, positions, generator=generator) < 0.7,
        logits.argmax(-1),
        torch.randint(0, vocab, (m, positions), generator=generator),
    )
    got = tree_accepted(logits, truth, budgets)
    for row, budget in enumerate(budgets):
        for anchor in range(m):
            tree = heap_tree(torch.log_softmax(logits[anchor], -1), budget)
            depth = 0
            while depth < positions and tuple(truth[anchor, : depth + 1].tolist()) in tree:
                depth += 1
            assert got[row, anchor].item() == depth, (seed, budget, anchor)


# --- the pruned scorer against the full per-depth beam, the literal heap and a brute force ---------


def _truths(logits, generator, p_argmax=0.7):
    m, positions, vocab = logits.shape
    truth = torch.where(
        torch.rand(m, positions, generator=generator) < p_argmax,
        logits.argmax(-1),
        torch.randint(0, vocab, (m, positions), generator=generator),
    )
    cut = torch.randint(0, positions + 1, (m, 1), generator=generator)  # some rows end early (-1)
    return torch.where(torch.arange(positions)[None] < cut, truth, torch.full_like(truth, -1))


def _adversarial(kind, generator, m, positions, vocab):
    if kind == "integer":  # few distinct logits: exact ties between siblings and between paths
        return torch.randint(0, 3, (m, positions, vocab), generator=generator).float()
    if kind == "flat":
        return torch.zeros(m, positions, vocab)
    if kind == "peaked":  # one token takes (nearly) all mass: log-probs of exactly 0 and very negative
        logits = torch.randn(m, positions, vocab, generator=generator)
        logits[..., 0] += 60.0
        return logits
    if kind == "bf16":  # bf16-rounded logits as the drafter emits them
        return (torch.randn(m, positions, vocab, generator=generator) * 4).bfloat16()
    raise ValueError(kind)


def _brute_force(logits, truth, budgets):
    """Every tree node enumerated: the truth node at depth d is in DDTree-N iff its token is in the
    position's top min(N_max, V) and fewer than N nodes score strictly better (path-order float32 sums)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    width = min(max(budgets), logprobs.shape[-1])
    values, indices = torch.topk(logprobs, width, dim=-1)
    out = torch.zeros(len(budgets), logits.shape[0], dtype=torch.int64)
    for anchor in range(logits.shape[0]):
        scores = []
        for depth in range(logits.shape[1]):
            for ranks in product(range(width), repeat=depth + 1):
                total = torch.zeros(())
                for d, r in enumerate(ranks):
                    total = total + values[anchor, d, r]
                scores.append(float(total))
        scores = torch.tensor(scores)
        for row, budget in enumerate(budgets):
            depth, total = 0, torch.zeros(())
            while depth < logits.shape[1]:
                hit = (indices[anchor, depth] == truth[anchor, depth]).nonzero()
                if truth[anchor, depth] < 0 or len(hit) == 0:
                    break
                total = total + values[anchor, depth, int(hit[0])]
                if int((scores > float(total)).sum()) >= budget:
                    break
                depth += 1
            out[row, anchor] = depth
    return out


def test_hand_computed_deeper_node_outscores_the_truth():
    # (0) .6, (0,0) .6 * .99 = .594, then the truth (1) .4: it is the third node
    probs = [[0.6, 0.4], [0.99, 0.01]]
    got = tree_accepted(_logits(probs), torch.tensor([[1, 0]]), [1, 2, 3, 4]).flatten().tolist()
    assert got == [0, 0, 1, 2]  # (1,0) .396 is the fourth


def test_hand_computed_exact_tie_goes_to_the_truth():
    # tokens 0 and 1 tie at .5; whichever a top-k ranks first, the truth is in a tree of one node
    probs = [[0.5, 0.5, 1e-9], [0.5, 0.5, 1e-9]]
    for truth in ([[0, 1]], [[1, 0]], [[1, 1]]):
        assert tree_accepted(_logits(probs), torch.tensor(truth), [1, 2, 3]).flatten().tolist() == [1, 1, 2]


@pytest.mark.parametrize("seed", range(40))
def test_pruned_equals_full_beam_on_random_logits(seed):
    generator = torch.Generator().manual_seed(seed)
    m, positions, vocab = 6, 1 + seed % 8, (7, 40, 300)[seed % 3]
    logits = torch.randn(m, positions, vocab, generator=generator) * (0.3 + seed % 5)
    budgets = [1, 2, 3, 8, 16, 33, 64][: 3 + seed % 5]
    truth = _truths(logits, generator)
    assert torch.equal(tree_accepted(logits, truth, budgets), beam_tree_accepted(logits, truth, budgets))


@pytest.mark.parametrize("kind", ["integer", "flat", "peaked", "bf16"])
@pytest.mark.parametrize("seed", range(6))
def test_pruned_equals_full_beam_on_adversarial_logits(kind, seed):
    generator = torch.Generator().manual_seed(100 + seed)
    logits = _adversarial(kind, generator, 8, 2 + seed % 6, (5, 24, 130)[seed % 3])
    truth = _truths(logits.float(), generator, p_argmax=0.9)
    budgets = [1, 4, 7, 16, 50]
    assert torch.equal(tree_accepted(logits, truth, budgets), beam_tree_accepted(logits, truth, budgets))


@pytest.mark.parametrize("kind", ["random", "integer", "flat", "peaked", "bf16"])
def test_pruned_equals_brute_force_ties_included(kind):
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 4, 4, generator=generator) if kind == "random" else _adversarial(kind, generator, 6, 4, 4)
    truth = _truths(logits.float(), generator, p_argmax=0.8)
    budgets = [1, 2, 3, 5, 9, 17, 40]
    assert torch.equal(tree_accepted(logits, truth, budgets), _brute_force(logits, truth, budgets))


@pytest.mark.parametrize("seed", range(12))
def test_pruned_equals_heap_tree_and_heap_never_exceeds_it_at_ties(seed):
    generator = torch.Generator().manual_seed(200 + seed)
    kind = ("random", "integer", "bf16")[seed % 3]
    positions, vocab = 2 + seed % 5, 9
    logits = (
        torch.randn(5, positions, vocab, generator=generator)
        if kind == "random"
        else _adversarial(kind, generator, 5, positions, vocab)
    )
    truth = _truths(logits.float(), generator, p_argmax=0.8)
    budgets = [1, 3, 6, 12, 25]
    got = tree_accepted(logits, truth, budgets)
    for row, budget in enumerate(budgets):
        for anchor in range(5):
            tree = heap_tree(torch.log_softmax(logits[anchor].float(), -1), budget)
            depth = 0
            while depth < positions and tuple(truth[anchor, : depth + 1].tolist()) in tree:
                depth += 1
            if kind == "random":
                assert got[row, anchor].item() == depth, (seed, budget, anchor)
            else:  # the heap breaks an exact tie by rank, against the truth as often as not
                assert got[row, anchor].item() >= depth, (seed, budget, anchor)


def test_large_budgets_equal_full_beam():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 7, 2048, generator=generator) * 3
    logits[..., :8] += 6.0  # a few plausible tokens per position, as a trained drafter has
    truth = _truths(logits, generator, p_argmax=0.6)
    budgets = [8, 64, 256, 512]
    assert torch.equal(tree_accepted(logits, truth, budgets), beam_tree_accepted(logits, truth, budgets))


def test_previous_cumsum_truth_score_was_off_by_one_node():
    """The version before this one summed the truth path with a cumsum (float64 on CPU): its own node
    could then count as better than itself. The heap agrees with the path-order sum."""
    found = 0
    for seed in range(60):
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(8, 8, 10, generator=generator) * (0.5 + seed % 4)
        truth = _truths(logits, generator, p_argmax=0.8)
        budgets = [2, 3, 5, 8, 13, 21, 34]
        old = beam_tree_accepted(logits, truth, budgets, path_order_sum=False)
        new = tree_accepted(logits, truth, budgets)
        assert bool((old <= new).all())
        for row, anchor in (old != new).nonzero().tolist():
            found += 1
            tree = heap_tree(torch.log_softmax(logits[anchor], -1), budgets[row])
            depth = 0
            while depth < 8 and tuple(truth[anchor, : depth + 1].tolist()) in tree:
                depth += 1
            assert new[row, anchor].item() == depth
    assert found > 0


@pytest.mark.parametrize("budget, parents, width", [(8, 8, 8), (64, 13, 5), (1, 1, 1), (100, 40, 64), (16, 3, 16)])
def test_candidate_pairs_are_every_pair_within_the_budget(budget, parents, width):
    from dflash_eval.evaluate.ddtree import candidate_pairs

    parent, token = candidate_pairs(budget, parents, width, torch.device("cpu"))
    expected = [(i, j) for i in range(parents) for j in range(width) if (i + 1) * (j + 1) <= budget]
    assert list(zip(parent.tolist(), token.tolist())) == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_top_log_probs_are_a_top_k_of_the_log_probs_bit_for_bit(dtype):
    """The top-k runs on the logits and gathers the log-probs: the same sorted bits as a top-k of the log-probs,
    ties included (coarse logits give many), and the truth found in it wherever the logits rank it inside."""
    from dflash_eval.evaluate.ddtree import truth_path_ranks

    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 5, 300, generator=generator) * 4).round().to(dtype)  # integers: ties everywhere
    logits[0, :, 7] = 30.0  # one clear winner in a row
    truth = torch.randint(0, 300, (6, 5), generator=generator)
    truth[1, 2] = -1
    width = 16
    values, exists, _ = truth_path_ranks(logits, truth, width)
    expected = torch.topk(torch.log_softmax(logits.float(), dim=-1), width, dim=-1).values
    assert values.dtype == torch.float32
    assert torch.equal(values, expected)
    kth = torch.topk(logits.float(), width, dim=-1).values[..., -1]
    clearly_inside = (logits.float().gather(-1, truth.clamp(min=0)[..., None])[..., 0] > kth) & (truth >= 0)
    strictly = clearly_inside.to(torch.int64).cumprod(dim=-1).bool()
    assert not (strictly & ~exists).any()  # a truth ranked strictly inside is always found
