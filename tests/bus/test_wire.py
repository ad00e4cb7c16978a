"""The wire format round-trips exactly and rejects what does not follow the schema."""

import msgpack
import numpy as np
import pytest
import torch

from actbus.wire import (
    SCHEMA_VERSION,
    Header,
    RowIndex,
    WireError,
    frame_to_tensor,
    tensor_to_frame,
)


def _header(dtype="float32", rows=3, hidden=8):
    ri = RowIndex(["a", "b"], np.array([0, 2, rows]), np.arange(rows), np.arange(rows) + 100)
    return Header(
        step=5,
        layer=1,
        hook="post_block",
        dtype=dtype,
        shape=(rows, hidden),
        model="m",
        rows=ri,
        tags={"label": 1},
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_exact(dtype):
    h = _header(str(dtype).removeprefix("torch."))
    t = torch.randn(3, 8).to(dtype)
    h2 = Header.decode(h.encode())
    assert h2.rows.row_request_ids() == ["a", "a", "b"]
    assert h2.rows.token_ids.tolist() == [100, 101, 102] and h2.tags == {"label": 1}
    back = frame_to_tensor(bytes(tensor_to_frame(t)), h2)
    assert back.dtype == dtype and torch.equal(back, t)


def test_header_is_small_for_many_rows():
    ri = RowIndex(
        [f"req-{i}" for i in range(256)],
        np.linspace(0, 8192, 257).astype(np.int64),
        np.arange(8192),
        np.arange(8192),
    )
    h = Header(0, 0, "post_block", "bfloat16", (8192, 4096), "m", ri)
    assert len(h.encode()) < 8192 * 8 + 257 * 4 + 256 * 16  # two int32 arrays, offsets, ids


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b"\x93garbage", "undecodable"),
        (msgpack.packb([1, 2]), "not a map"),
        (msgpack.packb({"schema": SCHEMA_VERSION + 1}), "schema version"),
        (msgpack.packb({"schema": SCHEMA_VERSION, "step": 1}), "bad header field"),
    ],
)
def test_malformed_headers_raise_wire_error(raw, needle):
    with pytest.raises(WireError, match=needle):
        Header.decode(raw)


def test_truncated_header_and_frame_are_rejected():
    raw = _header().encode()
    for cut in (1, len(raw) // 2, len(raw) - 1):
        with pytest.raises(WireError):
            Header.decode(raw[:cut])
    with pytest.raises(WireError, match="tensor frame has"):
        frame_to_tensor(b"\0" * 10, _header())


def test_request_tags_ends_and_selection_round_trip():
    from actbus.wire import RequestEnd

    ri = RowIndex(
        ["a", "b", "c"],
        np.array([0, 2, 2, 5]),
        np.array([0, 1, 7, 8, 9]),
        np.arange(5) + 100,
        sample_index=[0, 1, 0],
        tags=[{"label": 1}, {}, {"label": 0, "split": "train"}],
    )
    h = Header(3, 1, "post_block", "float32", (5, 4), "m", ri, ended=[RequestEnd("z", 0, "abort")])
    h2 = Header.decode(h.encode())
    assert h2.rows.tags == ri.tags and h2.rows.sample_index == [0, 1, 0]
    assert h2.ended == [RequestEnd("z", 0, "abort")] and not h2.ended[0].complete
    sub, rows = h2.rows.select([0, 2])
    assert sub.request_ids == ["a", "c"] and sub.offsets.tolist() == [0, 2, 5]
    assert rows.tolist() == [0, 1, 2, 3, 4] and sub.positions.tolist() == [0, 1, 7, 8, 9]
    assert sub.request_tags(1) == {"label": 0, "split": "train"}
    sub, rows = h2.rows.select([2])
    assert rows.tolist() == [2, 3, 4] and sub.token_ids.tolist() == [102, 103, 104]
    assert (
        h2.rows.steer_versions == [] and "steer_versions" not in msgpack.unpackb(h.encode())["rows"]
    )  # absent when no request steers with a live vector: older decoders read it alike
    ri.steer_versions = [{"dir": 3}, {}, {"dir": 4, "tone": 2}]
    ri._wire = None
    h3 = Header.decode(h.encode())
    assert h3.rows.steer_versions == ri.steer_versions
    sub, _ = h3.rows.select([2])
    assert sub.request_steer_versions(0) == {"dir": 4, "tone": 2}
    # vLLM's own ids of returned requests, and of their ends: absent when none is
    # returned (older decoders read the header alike), kept through a filter's cut.
    assert "engine_ids" not in msgpack.unpackb(h.encode())["rows"]
    assert "ended_engine_ids" not in msgpack.unpackb(h.encode())
    ri.engine_ids, ri._wire = ["a-0badcafe", "", "c-12345678"], None
    h.ended = [RequestEnd("z", 0, "abort"), RequestEnd("a", 0, "stop", "a-0badcafe")]
    h4 = Header.decode(h.encode())
    assert h4.rows.engine_ids == ri.engine_ids and h4.ended == h.ended
    assert h4.rows.keys() == ["a-0badcafe", "b", "c-12345678"]
    assert [e.key for e in h4.ended] == ["z", "a-0badcafe"]
    assert h4.rows.select([2])[0].engine_ids == ["c-12345678"]
    bad = msgpack.unpackb(h.encode())
    bad["rows"]["tags"] = [{}]
    with pytest.raises(WireError, match="tags must have one entry per request"):
        Header.decode(msgpack.packb(bad))


def test_per_row_expands_each_request_field_to_its_rows():
    tags = [{"label": 1}, {}, {"label": 0, "split": "train"}]
    ri = RowIndex(
        ["a", "b", "c"],
        np.array([0, 2, 3, 5]),
        np.arange(5),
        np.arange(5),
        sample_index=[0, 1, 0],
        tags=tags,
    )
    assert ri.row_request_ids() == ["a", "a", "b", "c", "c"]
    sample = ri.row_sample_index()
    assert sample.dtype == np.int32 and sample.tolist() == [0, 0, 1, 0, 0]
    row_tags = ri.row_tags()
    assert row_tags == [tags[0], tags[0], tags[1], tags[2], tags[2]]
    assert row_tags[0] is tags[0] and row_tags[4] is tags[2]  # shared, not copied
    # A numpy field keeps its dtype and trailing dimensions: per-request label vectors.
    labels = ri.per_row(np.array([[1, 2], [3, 4], [5, 6]], dtype=np.float32))
    assert labels.dtype == np.float32
    assert labels.tolist() == [[1, 2], [1, 2], [3, 4], [5, 6], [5, 6]]
    # A list entry is one value, not a row of values.
    assert ri.per_row([[1], [2, 3], []]).tolist() == [[1], [1], [2, 3], [], []]
    # Absent per-request lists read as their defaults.
    bare = RowIndex(["a"], np.array([0, 2]), np.arange(2), np.arange(2))
    assert bare.row_sample_index().tolist() == [0, 0] and bare.row_tags() == [{}, {}]
    assert RowIndex.empty().row_request_ids() == [] and RowIndex.empty().row_tags() == []
    with pytest.raises(ValueError, match="2 values for 3 requests"):
        ri.per_row(["x", "y"])


def _set(path, value):
    """A mutation of a header's decoded map: ``path`` is a key, or keys into ``rows``."""

    def apply(d):
        *parents, last = path
        for k in parents:
            d = d[k]
        d[last] = value

    return apply


BIG = "x" * 10_000_000  # a 10 MB field: refused, and never quoted whole


@pytest.mark.parametrize(
    ("mutate", "field", "needle"),
    [
        (_set(["hook"], "../../x"), "hook", "'../../x' is not a known hook"),
        (_set(["hook"], "/tmp/evil"), "hook", "is not a known hook"),
        (_set(["hook"], "post_block/../.."), "hook", "is not a known hook"),
        (_set(["hook"], 7), "hook", "is not a known hook"),
        (_set(["hook"], BIG), "hook", r"\.\.\. \(10000000 characters\)"),
        (_set(["layer"], -1), "layer", r"-1 is not an integer in \[0, 2147483647\]"),
        (_set(["layer"], 1 << 40), "layer", "is not an integer in"),
        (_set(["layer"], "3"), "layer", "is not an integer in"),
        (_set(["layer"], True), "layer", "is not an integer in"),
        (_set(["step"], -5), "step", "is not an integer in"),
        (_set(["step"], (1 << 64) - 1), "step", "is not an integer in"),
        (_set(["dtype"], "int64"), "dtype", "'int64' is not a known dtype"),
        (_set(["dtype"], ["float32"]), "dtype", "is not a known dtype"),
        (_set(["shape"], [3, 0]), "shape", r"'shape' width: 0 is not an integer in \[1,"),
        (_set(["shape"], [3, -8]), "shape", "'shape' width"),
        (_set(["shape"], [3, 1 << 33]), "shape", "'shape' width"),
        (_set(["shape"], [24]), "shape", "is not \\[rows, width\\]"),
        (_set(["shape"], [2, 8]), "shape", "2 rows, the row index has 3"),
        (_set(["model"], BIG), "model", "10000000 characters, more than the 4096 allowed"),
        (_set(["rows", "request_ids"], ["a" * 4097, "b"]), "request_ids", "more than the 4096"),
        (_set(["rows", "request_ids"], [1, "b"]), "request_ids", "1 is not a string"),
        (_set(["rows", "request_ids"], "ab"), "request_ids", "is not a list"),
        (_set(["rows", "sample_index"], [-1, 0]), "sample_index", "-1 is not an integer"),
        (_set(["rows", "tags"], [{f"k{i}": i for i in range(4097)}, {}]), "tags", "4097 tags"),
        (_set(["rows", "tags"], [{"k": "v" * 4097}, {}]), "tags", "'tags' value: 4097"),
        (_set(["rows", "tags"], [{"k" * 4097: 1}, {}]), "tags", "'tags' key: 4097"),
        (_set(["rows", "tags"], [{"k": b"raw"}, {}]), "tags", "a value of type bytes"),
        (
            _set(["rows", "tags"], [{"k": [[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]}, {}]),
            "tags",
            "deeper than 16",
        ),
        (_set(["rows", "tags"], [{"k": list(range(5000))}, {}]), "tags", "more than 4096 values"),
        (_set(["rows", "tags"], ["label", {}]), "tags", "is not a map"),
        (_set(["rows", "returned"], [1, 0]), "returned", "must be booleans"),
        (_set(["rows", "steer_versions"], [{"v": 0}, {}]), "steer_versions", "version: 0 is not"),
        (_set(["rows", "steer_versions"], [{"v": "2"}, {}]), "steer_versions", "is not an integ"),
        (_set(["rows", "steer_versions"], [[1], {}]), "steer_versions", "is not a map of at"),
        (_set(["rows", "steer_versions"], [{}]), "steer_versions", "one entry per request"),
        (
            _set(["rows", "steer_versions"], [{"v" * 201: 2}, {}]),
            "steer_versions",
            "name: 201 characters",
        ),
        (_set(["tags"], {f"k{i}": i for i in range(5000)}), "tags", "5000 tags"),
        (_set(["ended"], [["z" * 5000, 0, "stop"]]), "ended", "request id: 5000 characters"),
        (_set(["ended"], [["z", 0, "r" * 100]]), "ended", "reason: 100 characters"),
        (_set(["ended"], [["z", -2, "stop"]]), "ended", "sample index: -2"),
        (_set(["ended"], [["z"]]), "ended", "is not \\[request_id, sample_index, reason\\]"),
        (_set(["rows", "engine_ids"], ["a-1", 5]), "engine_ids", "5 is not a string"),
        (_set(["rows", "engine_ids"], ["a"]), "engine_ids", "one entry per request"),
        (_set(["rows", "engine_ids"], ["e" * 4097, ""]), "engine_ids", "more than the 4096"),
        (_set(["ended_engine_ids"], ["x", "y"]), "ended_engine_ids", "one entry per 'ended'"),
    ],
)
def test_every_header_field_is_checked_against_its_bound(mutate, field, needle):
    """What a consumer uses as a path part, a type, a size or log text is refused at
    decode time, with the field named and the bound said; a peer's value is never
    quoted whole (a 10 MB field makes an error of a few hundred characters)."""
    d = msgpack.unpackb(_header().encode())
    d["rows"]["sample_index"] = [0, 0]
    d["rows"]["tags"] = [{"lang": "en"}, {}]
    Header.decode(msgpack.packb(d))  # the unmutated header is good
    mutate(d)
    with pytest.raises(WireError, match=needle) as err:
        Header.decode(msgpack.packb(d))
    assert err.value.field == field
    assert len(str(err.value)) < 400


def test_headers_at_their_bounds_are_accepted():
    d = msgpack.unpackb(_header().encode())
    d["layer"] = (1 << 31) - 1
    d["step"] = (1 << 63) - 1
    d["model"] = "m" * 4096
    d["rows"]["request_ids"] = ["a" * 4096, "b"]
    deep: list = [1]
    for _ in range(14):
        deep = [deep]
    d["rows"]["tags"] = [
        {**{f"k{i}": i for i in range(4095)}, "s" * 4096: "v" * 4096},
        {"k": [{"a": [1, 2.5]}, None], "deep": deep},
    ]
    d["ended"] = [["z" * 4096, (1 << 31) - 1, "r" * 64]]
    h = Header.decode(msgpack.packb(d))
    assert h.layer == (1 << 31) - 1 and h.rows.request_tags(1)["deep"] == deep
    assert len(h.rows.request_tags(0)) == 4096


def test_a_tensor_frame_that_disagrees_with_the_shape_names_it():
    h = _header()
    with pytest.raises(WireError, match=r"header says 96 \(shape \(3, 8\), float32\)") as err:
        frame_to_tensor(b"\0" * 95, h)
    assert err.value.field == "shape"
