"""The target's last layer: what a drafter that taps it gets, offline = the reference loop, and a mismatch refused.

`dflash_generate` feeds a drafter `hidden_states[id + 1]`; for the last layer transformers puts the final-norm
output there, not the layer's own output that a hook on the layer sees. A drafter trained with the reference
loop therefore expects the final-norm output at its last-layer id (capture.LAST_LAYER "final_norm", the default).
"""

from types import SimpleNamespace

import pytest
import torch

from dflash_eval.demo.drafters import TrainingSequence
from dflash_eval.demo.reference import run_reference_loop
from dflash_eval.drafters import layerset_last_layer, layerset_name, parse_layerset
from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate.acceptance import sequence_limits
from dflash_eval.evaluate.all_anchor import evaluate_sample
from dflash_eval.evaluate.blocks import BlockDrafter
from dflash_eval.evaluate.stage import check_last_layer
from dflash_eval.extract.capture import capture_layers
from dflash_eval.methods import chain_method
from tests.support.reference import _draft_logprobs, assert_same_steps
from tests.support.tiny import MASK_ID, tiny_drafter, tiny_target, train_briefly

EOS, MAX_NEW, BLOCK, TIE = 1, 40, 4, 1e-5
LAYERS = [0, 3]  # 3: the last of the tiny target's 4 layers


def features(target, tokens, last_layer):
    states = capture_layers(target, LAYERS, tokens, want_argmax=False, last_layer=last_layer).states
    return torch.cat([states[i] for i in LAYERS], dim=-1)


@pytest.fixture(scope="module")
def trained():
    target = tiny_target(seed=0)
    sequences = []
    with torch.no_grad():
        for i in range(6):
            prompt = torch.randint(2, 290, (10 + i,), generator=torch.Generator().manual_seed(i))
            ids = target.generate(
                prompt[None], max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS, pad_token_id=EOS
            )[0]
            hidden = target(ids[None], output_hidden_states=True).hidden_states  # as dflash_generate sees them
            sequences.append(TrainingSequence(ids, torch.cat([hidden[i + 1][0] for i in LAYERS], dim=-1), len(prompt)))
    drafter = tiny_drafter(LAYERS, block_size=BLOCK, window=5)
    runner = BlockDrafter(drafter, target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach(), MASK_ID)
    train_briefly(drafter, runner, sequences)
    return target, drafter, runner, sequences


def test_final_norm_capture_is_what_the_reference_loop_feeds(trained):
    target, _, _, sequences = trained
    tokens = sequences[0].tokens
    assert torch.equal(features(target, tokens, "final_norm"), sequences[0].features)
    assert not torch.allclose(features(target, tokens, "pre_norm"), sequences[0].features)


def offline_steps(target, runner, sequence, last_layer):
    limits = sequence_limits(sequence.prompt_len, len(sequence.tokens), MAX_NEW, int(sequence.tokens[-1]) == EOS)
    return evaluate_sample(
        runner,
        features(target, sequence.tokens, last_layer),
        sequence.tokens,
        limits,
        {EOS},
        block_sizes=[BLOCK],
        budgets=[],
        chunk=7,
    ).steps[chain_method(BLOCK)]


def test_offline_equals_online_for_a_drafter_that_taps_the_last_layer(trained):
    target, drafter, runner, sequences = trained
    compared, differs_pre_norm = 0, 0
    for sequence in sequences:
        prompt, ids = sequence.tokens[: sequence.prompt_len].tolist(), sequence.tokens.tolist()
        ref_steps, ref_ids = run_reference_loop(drafter, target, prompt, MAX_NEW, [EOS], block_size=BLOCK)
        mine = offline_steps(target, runner, sequence, "final_norm")

        def draft(anchor, ids=ids, end=sequence.prompt_len + MAX_NEW):
            return _draft_logprobs(drafter, target, ids, anchor, min(BLOCK, end - anchor))

        compared += assert_same_steps(mine, ref_steps, ref_ids, ids, sequence.prompt_len, target, TIE, draft)
        differs_pre_norm += offline_steps(target, runner, sequence, "pre_norm") != ref_steps
    assert compared > 40, "too few steps compared for a meaningful test"
    assert differs_pre_norm > 0  # the layer's own output is not what the drafter was trained on


def test_a_last_layer_mismatch_is_refused_with_the_fix():
    def cache(held):
        target = {"num_hidden_layers": 4, **({} if held is None else {"last_layer": held})}
        return SimpleNamespace(directory="results/hidden/d/L0-3", manifest={"target": target})

    def settings(layers, wanted):
        return {"drafter": "dr", "checkpoint": {"layer_ids": layers, "last_layer": wanted}}

    check_last_layer(cache("final_norm"), settings([0, 3], "final_norm"))
    check_last_layer(cache("pre_norm"), settings([0, 2], "final_norm"))  # does not tap the last layer
    for held, wanted in (("pre_norm", "final_norm"), (None, "final_norm"), ("final_norm", "pre_norm")):
        with pytest.raises(DflashEvalError, match=r"drafters\.dr\.last_layer") as error:
            check_last_layer(cache(held), settings([0, 3], wanted))
        assert f"trained on its {wanted} output" in str(error.value)


def test_layer_set_names_tell_the_conventions_apart():
    assert layerset_name([3, 11, 31], "final_norm") == "L3-11-31"
    assert layerset_name([3, 11, 31], "pre_norm") == "L3-11-31-prenorm"
    for name in ("L3-11-31", "L3-11-31-prenorm"):
        assert parse_layerset(name) == [3, 11, 31]
    assert [layerset_last_layer(n) for n in ("L3-11-31", "L3-11-31-prenorm")] == ["final_norm", "pre_norm"]
