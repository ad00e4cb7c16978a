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
