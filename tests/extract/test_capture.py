"""Layer capture by hooks: layer id i is decoder layer i's output, before any norm."""

import pytest
import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from dflash_eval.errors import DflashEvalError
from dflash_eval.extract.backends import use_backend
from dflash_eval.extract.capture import capture_layers, text_parts
from tests.support.tiny import tiny_target

TOKENS = torch.randint(2, 290, (19,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", autouse=True)
def torch_kernels():
    """CPU forwards must not reach fla's Triton kernels where fla happens to import."""
    with use_backend("torch", "cpu"):
        yield


@pytest.fixture(scope="module")
def model():
    return tiny_target()


@pytest.fixture(scope="module")
def reference(model):
    with torch.no_grad():
        return model(TOKENS[None], output_hidden_states=True, use_cache=False)


def test_capture_equals_hidden_states_below_the_last_layer(model, reference):
    captured = capture_layers(model, [0, 1, 2], TOKENS, last_layer="final_norm")
    for i in (0, 1, 2):
        assert captured.states[i].shape == (19, 64)
        assert torch.equal(captured.states[i], reference.hidden_states[i + 1][0])


def test_last_layer_is_the_final_norm_output_by_default_and_the_residual_when_pre_norm(model, reference):
    """The default is what dflash_generate feeds (hidden_states[num_layers], the final-norm output)."""
    last = model.config.num_hidden_layers - 1
    assert torch.equal(
        capture_layers(model, [last], TOKENS, last_layer="final_norm").states[last], reference.hidden_states[-1][0]
    )
    for want_argmax in (True, False):
        state = capture_layers(model, [last], TOKENS, want_argmax=want_argmax, last_layer="pre_norm").states[last]
        assert not torch.allclose(state, reference.hidden_states[-1][0])
        with torch.no_grad():
            assert torch.equal(model.model.norm(state), reference.hidden_states[-1][0])


def test_argmax_is_the_targets_greedy_token(model, reference):
    captured = capture_layers(model, [1, 3], TOKENS, last_layer="final_norm")
    assert torch.equal(captured.argmax, reference.logits[0].argmax(-1))
    assert list(captured.states) == [1, 3]


def test_argmax_in_chunks_equals_the_full_logits_argmax_and_bounds_the_rows(model, reference, monkeypatch):
    """The head runs over at most ARGMAX_CHUNK positions at a time (bounded logits memory), same tokens."""
    from dflash_eval.extract import capture

    rows: list[int] = []
    head = model.lm_head
    monkeypatch.setattr(capture, "ARGMAX_CHUNK", 5)
    original = head.forward
    monkeypatch.setattr(head, "forward", lambda x: rows.append(len(x)) or original(x))
    captured = capture_layers(model, [1], TOKENS, last_layer="final_norm")
    assert rows == [5, 5, 5, 4]
    assert torch.equal(captured.argmax, reference.logits[0].argmax(-1))


def test_layer_order_follows_the_request(model):
    assert list(capture_layers(model, [2, 0], TOKENS, last_layer="final_norm").states) == [2, 0]


def test_early_stop_skips_later_layers_and_the_head(model, reference):
    ran = []
    hooks_before = len(model.model.layers[1]._forward_hooks)
    handles = [layer.register_forward_hook(lambda *_, i=i: ran.append(i)) for i, layer in enumerate(model.model.layers)]
    handles.append(model.model.norm.register_forward_hook(lambda *_: ran.append("norm")))
    try:
        captured = capture_layers(model, [0, 1], TOKENS, want_argmax=False, last_layer="final_norm")
    finally:
        for handle in handles:
            handle.remove()
    assert ran == [0, 1]
    assert captured.argmax is None
    assert torch.equal(captured.states[1], reference.hidden_states[2][0])
    assert len(model.model.layers[1]._forward_hooks) == hooks_before  # our hooks removed after the stop


def test_without_argmax_the_full_forward_can_be_kept(model):
    ran = []
    handle = model.model.norm.register_forward_hook(lambda *_: ran.append("norm"))
    try:
        capture_layers(model, [0], TOKENS, want_argmax=False, stop_after_last=False, last_layer="final_norm")
    finally:
        handle.remove()
    assert ran == ["norm"]


@pytest.mark.parametrize("ids", [[4], [-1], [0, 0], []])
def test_bad_layer_ids_are_clear_errors(model, ids):
    with pytest.raises(DflashEvalError, match="layer ids"):
        capture_layers(model, ids, TOKENS, last_layer="final_norm")


def test_out_of_range_error_names_the_range(model):
    with pytest.raises(DflashEvalError, match=r"4 decoder layers, so ids must be in 0\.\.3"):
        capture_layers(model, [1, 4], TOKENS, last_layer="final_norm")


def test_stop_after_last_with_argmax_is_rejected(model):
    with pytest.raises(DflashEvalError, match="stop_after_last"):
        capture_layers(model, [0], TOKENS, want_argmax=True, stop_after_last=True, last_layer="final_norm")


def test_vlm_language_model_layers_are_captured(model):
    text = model.config.to_dict()
    config = Qwen3_5Config(
        text_config=text,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
    )
    vlm = Qwen3_5ForConditionalGeneration(config).eval()
    vlm.model.language_model.load_state_dict(model.model.state_dict())
    vlm.lm_head.load_state_dict(model.lm_head.state_dict())
    decoder, head = text_parts(vlm)
    assert decoder is vlm.model.language_model and head is vlm.lm_head
    ours = capture_layers(vlm, [0, 3], TOKENS, last_layer="final_norm")
    theirs = capture_layers(model, [0, 3], TOKENS, last_layer="final_norm")
    assert all(torch.equal(ours.states[i], theirs.states[i]) for i in (0, 3))
    assert torch.equal(ours.argmax, theirs.argmax)
