"""samples.csv is written without pandas, byte for byte as pandas' to_csv wrote it (the report reads it)."""

import io

import pandas as pd

from dflash_eval.evaluate.stage import SAMPLES_COLUMNS, samples_csv


def test_samples_csv_equals_pandas_to_csv():
    rows = [
        {
            "id": "a,1",
            "method": "chain-B8",
            "prompt_tokens": 49,
            "completion_tokens": 96,
            "steps": 15,
            "tokens": 95,
            "tau": 95 / 15,
            "acceptance_lengths": "8 8 7 1",
        },
        {
            "id": 'q"2',
            "method": "ddtree-8",
            "prompt_tokens": 12,
            "completion_tokens": 0,
            "steps": 0,
            "tokens": 0,
            "tau": float("nan"),
            "acceptance_lengths": "",
        },
        {
            "id": "3",
            "method": "chain-B2",
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "steps": 2,
            "tokens": 3,
            "tau": 1.5,
            "acceptance_lengths": "2 1",
        },
    ]
    assert samples_csv(rows) == pd.DataFrame(rows).to_csv(index=False)
    back = pd.read_csv(io.StringIO(samples_csv(rows)), dtype={"id": str, "acceptance_lengths": str})
    assert list(back["id"]) == ["a,1", 'q"2', "3"] and back["tau"].isna().tolist() == [False, True, False]


def test_no_samples_still_gives_the_header():
    assert samples_csv([]) == ",".join(SAMPLES_COLUMNS) + "\n"
