"""serving_profile.json: every bad field is an error naming the file and the field."""

import json

import pytest

from dflash_eval.cache.serving_profile import load_profile
from dflash_eval.errors import DflashEvalError


@pytest.mark.parametrize(
    "data, field",
    [
        ({"t_verify_ms": {"1": 2}}, "'t_ar_ms' is missing"),
        ({"t_ar_ms": -1, "t_verify_ms": {"1": 2}}, "'t_ar_ms' must be a positive number"),
        ({"t_ar_ms": "20", "t_verify_ms": {"1": 2}}, "'t_ar_ms' must be a positive number"),
        ({"t_ar_ms": 20, "t_verify_ms": {}}, "'t_verify_ms' must be an object"),
        ({"t_ar_ms": 20, "t_verify_ms": {"0": 2}}, "key '0' must be a token count"),
        ({"t_ar_ms": 20, "t_verify_ms": {"1.5": 2}}, "key '1.5' must be a token count"),
        ({"t_ar_ms": 20, "t_verify_ms": {"4": None}}, "'t_verify_ms.4' must be a positive number"),
        ({"t_ar_ms": 20, "t_verify_ms": {"4": 3}, "t_draft_ms": 0}, "'t_draft_ms' must be a positive number"),
        ({"t_ar_ms": 20, "t_verify_ms": {"4": 3}, "hybrid": "yes"}, "'hybrid' must be true or false"),
        ({"t_ar_ms": 20, "t_verify_ms": {"4": 3}, "t_step_ms": {"16": -2}}, "'t_step_ms.16' must be a positive number"),
        ([1, 2], "a JSON object"),
    ],
)
def test_bad_profile_fields_name_file_and_field(tmp_path, data, field):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    with pytest.raises(DflashEvalError, match=str(path)) as error:
        load_profile(path)
    assert field in str(error.value)


def test_profile_not_json_or_missing(tmp_path):
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(DflashEvalError, match="bad.json: not valid JSON"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(DflashEvalError, match="serving profile not found"):
        load_profile(tmp_path / "none.json")
