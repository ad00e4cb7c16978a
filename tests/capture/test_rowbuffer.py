"""A request's returned rows at one tap: kept in position order, handed out as views
that later growth, sorting and DELTA hand-outs never change."""

from __future__ import annotations

import numpy as np
import torch

from actbus.capture.rowbuffer import TapRows

WIDTH = 3


def _piece(positions: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows whose values name their position (bf16 holds these integers exactly)."""
    pos = np.asarray(positions, dtype=np.int64)
    rows = torch.tensor([[float(p)] * WIDTH for p in positions], dtype=torch.bfloat16)
    return pos, pos + 100, rows.view(torch.uint8).numpy()


def _one(t: TapRows, position: int) -> None:
    _, tok, rows = _piece([position])
    t.append_one(position, int(tok[0]), rows[0])


def _rows(t: TapRows, lo: int, hi: int) -> list[int]:
    pos, tok, rows = t.view(lo, hi)
    assert tok.tolist() == [p + 100 for p in pos.tolist()]
    assert rows.dtype == torch.bfloat16 and rows.shape == (hi - lo, WIDTH)
    assert rows[:, 0].tolist() == pos.tolist()
    return pos.tolist()


def test_rows_grow_past_their_capacity_and_earlier_views_keep_their_rows():
    t = TapRows(2 * WIDTH, torch.bfloat16, WIDTH, capacity=1)
    t.append(*_piece(list(range(10))))
    first = t.view(0, 10)
    for p in range(10, 60):
        _one(t, p)
    assert _rows(t, 0, 60) == list(range(60))
    assert first[0].tolist() == list(range(10)) and first[2][:, 0].tolist() == list(range(10))
    assert t.below(30) == 30 and t.pending_below(1000) == 60


def test_a_piece_out_of_order_is_sorted_in_without_touching_views_handed_out():
    t = TapRows(2 * WIDTH, torch.bfloat16, WIDTH, capacity=64)
    t.append(*_piece([0, 1, 2, 5, 6]))
    before = t.view(0, 5)
    t.append(*_piece([4, 3]))  # late, and reversed within itself
    assert _rows(t, 0, 7) == [0, 1, 2, 3, 4, 5, 6]
    _one(t, 8)
    _one(t, 7)  # a late single row
    assert _rows(t, 0, 9) == list(range(9))
    assert before[0].tolist() == [0, 1, 2, 5, 6]
    assert before[2][:, 0].tolist() == [0, 1, 2, 5, 6]


def test_rows_handed_out_are_let_go_at_the_next_growth_and_still_counted():
    t = TapRows(2 * WIDTH, torch.bfloat16, WIDTH, capacity=16)
    t.append(*_piece(list(range(16))))
    taken = t.view(t.start, t.start + 12)
    t.start += 12  # a DELTA output took 12 rows
    t.append(*_piece([16, 17]))  # full: moves the 4 + 2 rows not handed out
    assert t.released == 12 and t.start == 0 and t.end == 6
    assert _rows(t, 0, 6) == [12, 13, 14, 15, 16, 17]
    assert t.below(17) == 17 and t.pending_below(17) == 5
    assert taken[0].tolist() == list(range(12))
