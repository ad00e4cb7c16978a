"""JSON text from a peer (a request's ``vllm_xargs`` entry, a steering endpoint's body):
refused with the field named when too long (before parsing), not JSON, too deep, a list
too long or an integer past Python's digits, never a RecursionError or ValueError (an
HTTP 500)."""

from __future__ import annotations

import json

import pytest

from actbus.errors import ConfigError
from actbus.jsontext import MAX_DEPTH, parse_json_text


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[" * 100_000 + "]" * 100_000, "f: JSON nested deeper than 32 levels"),
        ('{"a":' * 40 + "1" + "}" * 40, "f: JSON nested deeper than 32 levels"),
        (json.dumps({"tags": {"k": "[[[[" * 1000}}), None),  # brackets in a string: fine
        ("{not json", "f: not valid JSON (Expecting property name"),
        (b"\xff\xfe", "f: not valid JSON"),
        ("x" * (5 << 20), "f: 5242880 bytes of JSON, more than the 4194304 allowed"),
        # Issue 45: every list's length is checked before its items, named by its path.
        ('{"positions": [' + "0," * 1_900_000 + "0]}", "f.positions: a list of 1900001 items"),
        ('{"steer": [{"vector": [' + "1," * 70_000 + "1]}]}", "f.steer[0].vector: a list of"),
        ('{"layers": [1, ' + "9" * 5000 + "]}", "f: an integer of 5000 digits at column 16"),
    ],
)
def test_hostile_json_text_is_a_named_error(text, needle):
    if needle is None:
        assert parse_json_text(text, "f")["tags"]["k"].startswith("[[[[")
        return
    with pytest.raises(ConfigError) as e:
        parse_json_text(text, "f")
    assert str(e.value).startswith(needle), str(e.value)
    assert len(str(e.value)) < 300


def test_depth_at_the_bound_and_a_wide_value_parse():
    nested: object = 1
    for _ in range(MAX_DEPTH):
        nested = [nested]
    assert parse_json_text(json.dumps(nested), "f") == nested
    wide = [{"vector": [0.25] * 4096, "layers": [1, 2]} for _ in range(64)]
    assert parse_json_text(json.dumps(wide), "f") == wide
