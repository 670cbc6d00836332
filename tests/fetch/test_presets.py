"""Named prompt presets: rows in the hub datasets' own column layouts (built here as tiny local files) become
exactly the prompts the DFlash benchmark (z-lab/dflash, dflash/benchmark.py) sends; offline without a copy is
a clear error; a config entry validates and reaches the fetch stage."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from dflash_eval import config as cfg
from dflash_eval.errors import DflashEvalError
from dflash_eval.fetch import stage as fetch
from dflash_eval.fetch.presets import PRESETS, load_preset
from dflash_eval.fetch.settings import dataset_inputs, fetch_settings
from dflash_eval.testing import fixtures

BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."

# A few rows of each hub dataset, with its real column names (and extra columns the presets must ignore).
ROWS = {
    "gsm8k": [
        {"question": "Tom has 3 apples. How many?", "answer": "3 #### 3"},
        {"question": "What is 2+2?", "answer": "#### 4"},
    ],
    "math500": [
        {
            "problem": "Solve $x^2=4$.",
            "solution": "...",
            "answer": "2",
            "subject": "Algebra",
            "level": 1,
            "unique_id": "test/algebra/1.json",
        }
    ],
    "humaneval": [
        {
            "task_id": "HumanEval/0",
            "prompt": 'def f(x):\n    """Return x."""\n',
            "canonical_solution": "    return x\n",
            "test": "assert f(1) == 1",
            "entry_point": "f",
        }
    ],
    "mbpp": [
        {
            "source_file": "a.py",
            "task_id": 11,
            "prompt": "Write a python function to remove a character.",
            "code": "...",
            "test_imports": [],
            "test_list": ["assert f(1)"],
        }
    ],
    "mt-bench": [
        {
            "prompt": ["Write a travel blog post.", "Rewrite it starting every sentence with A."],
            "prompt_id": 81,
            "category": "writing",
            "reference": [],
        }
    ],
}

EXPECTED = {
    "gsm8k": [
        ("gsm8k-0", [{"role": "user", "content": "Tom has 3 apples. How many?" + BOXED}], ()),
        ("gsm8k-1", [{"role": "user", "content": "What is 2+2?" + BOXED}], ()),
    ],
    "math500": [("math500-0", [{"role": "user", "content": "Solve $x^2=4$." + BOXED}], ())],
    "humaneval": [
        (
            "HumanEval/0",
            [
                {
                    "role": "user",
                    "content": "Write a solution to the following problem and make sure that it passes the tests:\n"
                    '```python\ndef f(x):\n    """Return x."""\n\n```',
                }
            ],
            (),
        )
    ],
    "mbpp": [("mbpp-11", [{"role": "user", "content": "Write a python function to remove a character."}], ())],
    "mt-bench": [("mt-bench-81", [], ("Write a travel blog post.", "Rewrite it starting every sentence with A."))],
}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def as_tuples(prompts) -> list[tuple]:
    return [(p.id, p.messages, p.turns) for p in prompts]


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_rows_become_the_dflash_benchmark_prompts(tmp_path, name):
    source = write_jsonl(tmp_path / f"{name}.jsonl", ROWS[name])
    assert as_tuples(load_preset(name, source)) == EXPECTED[name]


def test_parquet_file_and_hub_snapshot_directory(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    # gsm8k's hub layout: one folder per config, parquet shards named after the split
    for config, rows in (("main", ROWS["gsm8k"]), ("socratic", [{"question": "other", "answer": ""}])):
        for split in ("test", "train"):
            (tmp_path / "gsm8k" / config).mkdir(parents=True, exist_ok=True)
            pq.write_table(
                pa.Table.from_pylist(rows if split == "test" else rows[:1]),
                tmp_path / "gsm8k" / config / f"{split}-00000-of-00001.parquet",
            )
    assert as_tuples(load_preset("gsm8k", tmp_path / "gsm8k")) == EXPECTED["gsm8k"]
    assert (
        as_tuples(load_preset("gsm8k", tmp_path / "gsm8k" / "main" / "test-00000-of-00001.parquet"))
        == EXPECTED["gsm8k"]
    )
    # mt-bench's turns are a list column
    pq.write_table(pa.Table.from_pylist(ROWS["mt-bench"]), tmp_path / "mt.parquet")
    assert as_tuples(load_preset("mt-bench", tmp_path / "mt.parquet")) == EXPECTED["mt-bench"]
    # MATH-500's hub repo is one test.jsonl at its root
    write_jsonl(tmp_path / "math" / "test.jsonl", ROWS["math500"])
    assert as_tuples(load_preset("math500", tmp_path / "math")) == EXPECTED["math500"]


def test_a_file_of_another_dataset_is_named(tmp_path):
    source = write_jsonl(tmp_path / "x.jsonl", ROWS["math500"])
    with pytest.raises(
        DflashEvalError, match=r"preset gsm8k, .*x.jsonl row 0: no column \['question'\] .* openai/gsm8k \(main\)"
    ):
        load_preset("gsm8k", source)
    (tmp_path / "empty").mkdir()
    write_jsonl(tmp_path / "empty" / "train.jsonl", ROWS["gsm8k"])
    with pytest.raises(DflashEvalError, match=r"preset gsm8k: no .* file of the 'test' split under .*empty"):
        load_preset("gsm8k", tmp_path / "empty")
    with pytest.raises(
        DflashEvalError,
        match=r"preset humaneval: source .*missing does not exist; .*hf download --repo-type "
        r"dataset openai/openai_humaneval",
    ):
        load_preset("humaneval", tmp_path / "missing")


def test_no_hub_and_no_local_copy_says_how_to_provide_one(monkeypatch):
    """What `datasets.load_dataset` raises offline (ConnectionError: Couldn't reach ... on the Hub) is stood in
    for by a stub module, as importing the real one takes tens of seconds here; the slow test below uses it."""

    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(DflashEvalError) as err:
        load_preset("gsm8k")
    message = str(err.value)
    assert message.startswith("preset gsm8k: cannot load openai/gsm8k (main), split test from the Hugging Face hub")
    assert "ConnectionError: Couldn't reach" in message
    assert "hf download --repo-type dataset openai/gsm8k --local-dir DIR" in message and "`source: DIR`" in message


@pytest.mark.slow
def test_no_hub_with_the_real_datasets_package(monkeypatch, tmp_path):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(DflashEvalError, match=r"preset mbpp: cannot load google-research-datasets/mbpp \(sanitized\)"):
        load_preset("mbpp", cache_dir=str(tmp_path / "cache"))
    # a save_to_disk copy of the split loads without the hub
    datasets.Dataset.from_list(ROWS["mbpp"]).save_to_disk(str(tmp_path / "mbpp"))
    assert as_tuples(load_preset("mbpp", tmp_path / "mbpp")) == EXPECTED["mbpp"]


def base_config(tmp_path: Path, datasets: dict) -> dict:
    return {
        "target": {"path": "t", "device": "cpu", "backend": "torch"},
        "server": {"kind": "release", "base_url": "http://127.0.0.1:1"},
        "fetch": {},
        "extraction": {},
        "evaluation": {},
        "drafters": {"d": {"path": str(tmp_path / "d"), "layer_ids": [1]}},
        "datasets": datasets,
    }


def test_config_entry_validates_and_reaches_the_fetch_settings(tmp_path):
    source = str(write_jsonl(tmp_path / "gsm8k.jsonl", ROWS["gsm8k"]))
    config = cfg.validate_config(
        base_config(
            tmp_path,
            {
                "gsm8k": {"preset": "gsm8k", "max_samples": 1, "seed": 3, "source": source},
                "hub": {"preset": "mt-bench"},
                "file": {"prompts": "p.jsonl"},
            },
        )
    )
    settings = fetch_settings(config, "gsm8k")
    assert {k: settings[k] for k in ("dataset", "preset", "source", "cache_dir", "max_samples", "seed")} == {
        "dataset": "gsm8k",
        "preset": "gsm8k",
        "source": source,
        "cache_dir": None,
        "max_samples": 1,
        "seed": 3,
    }
    assert "prompts" not in settings and "preset" not in fetch_settings(config, "file")
    assert dataset_inputs(config, "gsm8k") == [source]
    assert dataset_inputs(config, "hub") == [] and dataset_inputs(config, "file") == []  # params.prompts
    prompts, origin = fetch.load_prompt_set(cfg.stage_settings("fetch", {**settings, "server": {}, "tokenizer": "t"}))
    assert origin == "preset gsm8k" and as_tuples(prompts) == EXPECTED["gsm8k"]


@pytest.mark.slow  # a server process and the fetch stage: ~40 s on the loaded 2-CPU machine
def test_fetch_of_a_preset_with_a_subset(tmp_path):
    """The preset goes through fetch like a prompt file: seeded subset, multi-turn records, fake server."""
    from tests.support import fake_fetch as ff

    tok = tmp_path / "tok"
    fixtures.build_tokenizer(tok)
    rows = [
        {"prompt": [f"Question {i}: first?", "and then?"], "prompt_id": 81 + i, "category": "c", "reference": []}
        for i in range(5)
    ]
    source = write_jsonl(tmp_path / "mt.jsonl", rows)
    with ff.fake(tok, None, "--sglang") as url:
        settings = ff.settings(tmp_path, url, tok, None, max_samples=2, seed=0, concurrency=2)
        del settings["prompts"]
        records = fetch.fetch({**settings, "preset": "mt-bench", "source": str(source)}, tmp_path / "o.jsonl")
    import random

    kept = sorted(random.Random(0).sample(range(5), 2))
    assert [r["id"] for r in records] == [f"mt-bench-{81 + i}#{t}" for i in kept for t in (1, 2)]
    assert records[1]["messages"] == [
        {"role": "user", "content": f"Question {kept[0]}: first?"},
        {"role": "assistant", "content": records[0]["text"]},
        {"role": "user", "content": "and then?"},
    ]


def test_a_missing_reader_package_names_the_file_and_both_fixes(tmp_path, monkeypatch):
    """A parquet copy without pyarrow is an error naming the file, the extra and the .jsonl way out."""
    from dflash_eval.fetch import presets

    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # None in sys.modules: the import fails
    source = tmp_path / "test-00000-of-00001.parquet"
    source.write_bytes(b"PAR1")
    with pytest.raises(
        DflashEvalError,
        match=r"test-00000-of-00001.parquet: reading a .parquet file needs the "
        r"`pyarrow` package: pip install 'dflash-eval\[presets\]', or convert",
    ):
        presets._read_file(source)
