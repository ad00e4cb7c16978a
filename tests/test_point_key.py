"""The one name of a (layer, hook) stream, and the older spellings it still reads."""

from __future__ import annotations

import pytest

from actbus.errors import ConfigError
from actbus.streams import HOOKS, parse_point_key, point_key


def test_every_stream_name_reads_back():
    for layer in (0, 3, 47, (1 << 31) - 1):
        for hook in HOOKS:
            assert parse_point_key(point_key(layer, hook)) == (layer, hook)
    assert point_key(3, "post_block") == "L3.post_block"


@pytest.mark.parametrize(
    "old", ["3/post_block", "L3/post_block", "layer-03/post_block", "layer-03-post_block"]
)
def test_older_spellings_read_as_the_same_stream(old):
    assert parse_point_key(old) == (3, "post_block")


@pytest.mark.parametrize(
    "bad",
    ["", "L3", "L3.", "3-post_block", "L3.post_block/x", "l3.post_block", "L-1.post_block",
     "L3.bogus", "L99999999999.post_block", "L" + "9" * 5000 + ".post_block", None, 3],
)  # fmt: skip
def test_anything_else_is_refused_naming_the_spelling(bad):
    with pytest.raises(ConfigError, match=r"L3\.post_block|unknown hook|past int32"):
        parse_point_key(bad)
