"""A request's returned rows at one tap: kept in position order, handed out as views
that later growth, sorting and DELTA hand-outs never change; in slabs shared by many
requests while they fit, freed once nothing refers to them (``TapRows``, and the
rows found by slot, ``SlotRows``; the scores' own are in tests/monitor)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import torch

from actbus.rowstore import SlabPool, TapRows, retire

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


def test_buffers_over_a_slab_write_into_it_and_leave_it_when_they_grow_or_sort():
    pool = SlabPool(slab_bytes=64 * 2 * WIDTH)  # room for 64 rows
    a = TapRows.over(pool, 2 * WIDTH, torch.bfloat16, WIDTH, capacity=16)
    b = TapRows.over(pool, 2 * WIDTH, torch.bfloat16, WIDTH, capacity=16)
    slab = a.home[0]
    assert b.home == (slab, 16, 16) and a.home == (slab, 0, 16)
    a.append(*_piece(list(range(10))))
    _one(b, 0)
    first = a.view(0, 10)
    assert first[2].data_ptr() == slab.rows.ctypes.data and _rows(b, 0, 1) == [0]
    for p in range(10, 40):  # past its 16 rows: it moves out, the views keep theirs
        _one(a, p)
    assert a.home is None and _rows(a, 0, 40) == list(range(40))
    assert first[2][:, 0].tolist() == list(range(10))
    _one(b, 2)
    _one(b, 1)  # out of order: sorted into memory of its own
    assert b.home is None and _rows(b, 0, 3) == [0, 1, 2]
    c = TapRows.over(pool, 2 * WIDTH, torch.bfloat16, WIDTH, capacity=40)
    assert c.home[0] is not slab  # 32 + 40 rows do not fit: a new slab


def test_a_slab_is_freed_once_no_buffer_and_no_view_refers_to_it():
    pool = SlabPool(slab_bytes=1 << 20)
    t = TapRows.over(pool, 2 * WIDTH, torch.bfloat16, WIDTH, capacity=16)
    t.append(*_piece([0, 1, 2]))
    held = t.view(0, 3)[2]
    memory = weakref.ref(t.home[0].memory)
    pool.release()
    del t
    gc.collect()
    assert memory() is not None and held[:, 0].tolist() == [0, 1, 2]  # the view keeps it
    del held
    gc.collect()
    assert memory() is None


def test_a_slab_mostly_collected_moves_its_survivors_out():
    """One long request must not keep its neighbours' rows: once the requests holding
    three quarters of a full slab are collected, the rest move to memory of their own."""
    pool = SlabPool(slab_bytes=128 * 2 * WIDTH)  # 128 rows: 8 buffers of 16
    bufs = [TapRows.over(pool, 2 * WIDTH, torch.bfloat16, WIDTH, capacity=16) for _ in range(8)]
    for t in bufs:
        t.append(*_piece([0, 1, 2]))
    slab = bufs[0].home[0]
    taken = bufs[7].view(0, 2)
    bufs[7].start = 2  # a DELTA output took 2 rows
    retire(bufs[:5], pool)  # still the slab being filled: nothing moves
    assert all(t.home is not None for t in bufs[5:])
    TapRows.over(pool, 2 * WIDTH, torch.bfloat16, WIDTH, capacity=16)  # full: a new one
    retire(bufs[5:6], pool)  # 2 of 8 left: a quarter, not under it
    assert bufs[6].home is not None and bufs[7].home is not None
    retire(bufs[6:7], pool)
    assert bufs[7].home is None and not slab.buffers
    assert _rows(bufs[7], 0, 1) == [2] and bufs[7].released == 2
    assert taken[0].tolist() == [0, 1] and taken[2][:, 0].tolist() == [0, 1]
    memory = weakref.ref(slab.memory)
    del slab, bufs, t
    gc.collect()
    assert memory() is not None  # the DELTA output's view keeps it
    del taken
    gc.collect()
    assert memory() is None


def _resident(a: np.ndarray) -> int:
    """Bytes of ``a`` (page-aligned) that the kernel has pages for (``mincore``)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = -(-a.nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(a.ctypes.data, a.nbytes, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


def _wait_resident(a: np.ndarray, nbytes: int) -> int:
    """``_resident(a)`` once it is ``nbytes`` (the populator's thread at work), or as it
    is after 30 s."""
    import time

    deadline = time.monotonic() + 30
    while _resident(a) != nbytes and time.monotonic() < deadline:
        time.sleep(0.05)
    return _resident(a)


def test_rows_past_those_handed_out_are_faulted_in_ahead_as_many_as_were_handed_out(
    monkeypatch,
):
    """A few rows handed out make a window of ``PREFAULT_MIN`` resident, not a slab
    (a whole spare slab, 256 MiB, was faulted in for the first row an HTTP server
    returned); more handed out, more ahead, into the next slab, handed out next. Idle,
    the pool gives back what it faulted in and never handed out."""
    import pytest

    from actbus import rowstore

    row = 4096  # a page a row
    monkeypatch.setattr(rowstore, "PREFAULT_MIN", 64 * row)
    pool = SlabPool(slab_bytes=1024 * row)
    if not pool.prefault:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    slab, _ = pool.take(4, row)  # 64 rows past these 4 are faulted in, no more
    slab.rows[10] = 7  # written while the populator may be at it
    assert _wait_resident(slab.rows, 64 * row) == 64 * row and not pool._spare
    assert (slab.rows[10] == 7).all()  # populating never changes a page
    pool.take(700, row)  # 704 handed out: as many past them, 320 here and 384 next
    assert _wait_resident(slab.rows, (64 + 320) * row) == (64 + 320) * row
    spare = pool._spare[row]
    assert _wait_resident(spare.rows, 384 * row) == 384 * row
    nxt, at = pool.take(400, row)  # no room left here: the next slab, already there
    assert nxt is spare and at == 0 and pool._spare[row] is not spare
    # 384 rows came ahead; those handed out past them (to 400) wait for their first write.
    assert _wait_resident(nxt.rows, (384 + 624) * row) == (384 + 624) * row
    pool.release()  # rows 400 on were never handed out: given back
    assert not pool._spare and _wait_resident(nxt.rows, 384 * row) == 384 * row


def test_slot_rows_of_any_row_kind_keep_their_views_and_free_their_slabs():
    """The scores' way (rows found by slot) over the same slabs, here with rows of
    bf16 activations: one scatter writes every slot's rows, a view handed out keeps
    its slab once every slot is freed, and the slab goes with the last view."""
    from actbus.rowstore import SlotRows, as_items

    s = SlotRows(2, slab_bytes=1 << 20, extra=("ver",))
    s.row_bytes = 2 * WIDTH
    pos, tok, rows = _piece([0, 1, 2, 0, 1])
    slots = np.array([0, 1])
    s.write(
        slots,
        np.array([0, 3]),
        np.array([3, 2]),
        True,
        pos,
        tok,
        as_items(rows),
        {"ver": 7},
        np.array([4, 4]),
    )
    st, lo, n = s.pending(0, 10)
    held = torch.from_numpy(st.rows[lo : lo + n]).view(torch.bfloat16)
    assert n == 3 and held[:, 0].tolist() == [0, 1, 2] and st.ver[lo : lo + n].tolist() == [7] * 3
    assert s.pending_below(1, 10) == 2 and s.held_below(1, 1) == 1
    memory = weakref.ref(st.memory)
    s.free(0)
    s.free(1)
    del st
    gc.collect()
    assert not s.stores and memory() is not None and held[:, 0].tolist() == [0, 1, 2]
    del held
    gc.collect()
    assert memory() is None
