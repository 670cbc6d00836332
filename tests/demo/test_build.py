"""The embedded demo's building blocks: tokenizer, tiny hybrid target, prompt set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5ForCausalLM

from dflash_eval.demo import corpus
from dflash_eval.demo.target import (
    FULL,
    LINEAR,
    make_target_config,
    qwen36_layer_types,
)
from dflash_eval.demo.tokenizer import (
    BUILD_INFO,
    ENDOFTEXT,
    IM_END,
    IM_START,
    MASK,
    build_tokenizer,
    mask_token_id,
)
from tests.support.tiny import build_demo_target

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "resources" / "prompts" / "demo_code.jsonl"


@pytest.fixture(scope="module")
def small_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo-format tokenizer on a small corpus: same code path as the real one, seconds to build."""
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out, seed=0, vocab_size=512, corpus_bytes=200_000)
    return out


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory, small_tokenizer_dir: Path) -> Path:
    return build_demo_target(tmp_path_factory.mktemp("tiny"), tokenizer_dir=small_tokenizer_dir)


# ---------------------------------------------------------------- corpus


def test_corpus_selection_is_seeded_and_capped() -> None:
    a = corpus.select_sources(seed=3, max_bytes=100_000)
    b = corpus.select_sources(seed=3, max_bytes=100_000)
    assert [f.relpath for f in a] == [f.relpath for f in b]
    assert 0 < sum(len(f.text) for f in a) <= 100_000
    assert all("site-packages" not in f.relpath and f.text.isascii() for f in a)
    assert corpus.corpus_fingerprint(a) == corpus.corpus_fingerprint(b)


def test_chat_examples_are_user_assistant_pairs() -> None:
    files = corpus.select_sources(seed=0, max_bytes=100_000)
    stream = corpus.chat_examples(files, seed=0)
    for _ in range(50):
        user, assistant = next(stream)
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert user["content"].strip() and assistant["content"].strip()


# ---------------------------------------------------------------- tokenizer

ROUND_TRIP_TEXTS = [
    "def foo(x):\n    return x + 1  # add one\n",
    "class A(B):\n\tpass\n\n\n  \n",
    "    if self._closed:\n        raise ValueError('I/O operation on closed file.')\n",
    "x = {'a': [1, 2.5e-3, None]}; print(f\"{x!r:>10}\")\r\n",
    "caf\u00e9 \u00fcber \u4e2d\u6587 \U0001f600",  # non-ASCII survives byte-level BPE
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text(small_tokenizer_dir: Path, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(small_tokenizer_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids


def test_tokenizer_special_tokens(small_tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(small_tokenizer_dir)
    assert tok.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END, MASK]) == [0, 1, 2, 3]
    assert tok.eos_token == IM_END and tok.pad_token == ENDOFTEXT
    assert mask_token_id(small_tokenizer_dir) == 3
    # Specials are atomic in text, never split into bytes.
    assert tok.encode(f"{IM_START}user\nhi{IM_END}", add_special_tokens=False)[0] == 1
    assert len(tok) == 512
    info = json.loads((small_tokenizer_dir / BUILD_INFO).read_text())
    assert info["corpus"]["sha256"] and info["special_token_ids"][MASK] == 3


def test_chat_template_is_chatml(small_tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(small_tokenizer_dir)
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Write code."},
        {"role": "assistant", "content": "pass"},
    ]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n"
        "<|im_start|>user\nWrite code.<|im_end|>\n"
        "<|im_start|>assistant\npass<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWrite code.<|im_end|>\n<|im_start|>assistant\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Write code."}]}]
    assert tok.apply_chat_template(parts, tokenize=False, add_generation_prompt=True) == prompt


def test_tokenizer_build_is_deterministic(small_tokenizer_dir: Path, tmp_path: Path) -> None:
    build_tokenizer(tmp_path, seed=0, vocab_size=512, corpus_bytes=200_000)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (small_tokenizer_dir / name).read_bytes(), name


# ---------------------------------------------------------------- target


def test_layer_pattern_is_qwen36() -> None:
    assert qwen36_layer_types(8) == [LINEAR, LINEAR, LINEAR, FULL] * 2
    with pytest.raises(ValueError):
        qwen36_layer_types(6)


def test_target_config_is_tiny_hybrid() -> None:
    config = make_target_config(4096, eos_token_id=2, bos_token_id=0, pad_token_id=0)
    assert config.model_type == "qwen3_5_text"
    assert set(config.layer_types) == {LINEAR, FULL}
    assert config.layer_types.count(LINEAR) == 3 * config.layer_types.count(FULL)
    assert not config.tie_word_embeddings
    assert config.eos_token_id == 2
    model = Qwen3_5ForCausalLM(config)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) < 5_000_000


def test_tiny_target_saves_and_loads(tiny_target_dir: Path, small_tokenizer_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    assert isinstance(model, Qwen3_5ForCausalLM)
    assert model.dtype == torch.float32
    assert set(model.config.layer_types) == {LINEAR, FULL}
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.convert_tokens_to_ids(IM_END)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.do_sample is False
    with safe_open(str(tiny_target_dir / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
        assert "lm_head.weight" in f.keys()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= ids.shape[1] + 4


# ---------------------------------------------------------------- prompts


def test_prompt_file_parses() -> None:
    records = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    ids = [r["id"] for r in records]
    assert len(set(ids)) == len(ids) >= 40
    for r in records:
        assert set(r) == {"id", "messages"}
        assert r["messages"] and r["messages"][-1]["role"] == "user"
        assert all(m["content"].strip() for m in r["messages"])
        assert len(r["messages"][-1]["content"]) <= 600  # ~200 demo tokens


# ---------------------------------------------------------------- slow: the real build


@pytest.mark.slow
def test_full_tokenizer_build(tmp_path: Path) -> None:
    build_tokenizer(tmp_path, seed=0)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 4096
    records = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    lengths = [
        len(tok.apply_chat_template(r["messages"], add_generation_prompt=True, return_dict=True)["input_ids"])
        for r in records
    ]
    assert max(lengths) <= 200
