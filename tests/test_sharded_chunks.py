"""The chunk-overlap planner (storage/chunks.py): any two shardings of any shape give the
full array back, and no copy addresses anything outside its saved chunk or its target."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_checkfreq.storage.chunks import (
    Box,
    ChunkLayoutError,
    as_bytes,
    assemble,
    byte_span,
    check_tiling,
    plan_copies,
    span_view,
    whole,
)

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@st.composite
def grid_split(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    """A mesh-like split: each dim cut at sorted points (uneven, empty pieces allowed),
    Shard(0) and Shard(1) being one cut dim, a 2-D mesh two."""
    cuts = []
    for size in shape:
        points = sorted(draw(st.lists(st.integers(0, size), max_size=3)))
        cuts.append([0, *points, size])
    boxes = [Box((), ())]
    for bounds in cuts:
        boxes = [Box(b.offsets + (lo,), b.sizes + (hi - lo,)) for b in boxes for lo, hi in zip(bounds, bounds[1:])]
    return boxes


@st.composite
def guillotine_split(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    """Recursive cuts along any dim: tilings that are not grids (each row block cut its own way)."""
    pending, done = [whole(shape)], []
    while pending:
        box = pending.pop()
        if not box.ndim or len(done) + len(pending) > 12 or not draw(st.booleans()):
            done.append(box)
            continue
        dim = draw(st.integers(0, box.ndim - 1))
        cut = draw(st.integers(0, box.sizes[dim]))
        low = Box(box.offsets, box.sizes[:dim] + (cut,) + box.sizes[dim + 1:])
        high_offsets = box.offsets[:dim] + (box.offsets[dim] + cut,) + box.offsets[dim + 1:]
        high = Box(high_offsets, box.sizes[:dim] + (box.sizes[dim] - cut,) + box.sizes[dim + 1:])
        pending += [low, high]
    return done


def sharding(shape: tuple[int, ...]) -> st.SearchStrategy[list[Box]]:
    return st.one_of(grid_split(shape), guillotine_split(shape))


@st.composite
def two_shardings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box], list[Box], np.dtype]:
    shape = draw(shapes)
    dtype = np.dtype(draw(st.sampled_from(["<f8", "<f4", "<i2", "u1"])))
    return shape, draw(sharding(shape)), draw(sharding(shape)), dtype


@settings(max_examples=300, deadline=None)
@given(two_shardings())
def test_any_two_shardings_give_the_full_array_back(case):
    shape, saved, targets, dtype = case
    full = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    check_tiling(shape, saved)
    check_tiling(shape, targets)
    chunks = [np.ascontiguousarray(full[b.slices()]).tobytes() for b in saved]
    rebuilt = np.empty(shape, dtype)
    for target in targets:
        piece = assemble(target, saved, chunks.__getitem__, dtype.itemsize)
        rebuilt[target.slices()] = piece.reshape(-1).view(dtype).reshape(target.sizes)
    np.testing.assert_array_equal(rebuilt, full)


@settings(max_examples=300, deadline=None)
@given(two_shardings())
def test_no_copy_reads_outside_its_chunk_nor_writes_outside_its_target(case):
    shape, saved, targets, dtype = case
    for target in targets:
        steps = plan_copies(saved, target)
        for step in steps:
            chunk = saved[step.source]
            assert step.source_box.fits(chunk.sizes), (chunk, step)
            assert step.target_box.fits(target.sizes), (target, step)
            start, stop = byte_span(chunk.sizes, step.source_box, dtype.itemsize)
            assert 0 <= start <= stop <= chunk.volume * dtype.itemsize
        check_tiling(target.sizes, [s.target_box for s in steps])  # each target element once


@settings(max_examples=300, deadline=None)
@given(two_shardings())
def test_a_byte_span_holds_exactly_the_sub_box(case):
    shape, saved, targets, dtype = case
    full = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    for target in targets:
        for step in plan_copies(saved, target):
            chunk = np.array(full[saved[step.source].slices()])  # 0-d stays 0-d
            start, stop = byte_span(chunk.shape, step.source_box, dtype.itemsize)
            span = np.frombuffer(chunk.tobytes()[start:stop], np.uint8)
            got = span_view(span, chunk.shape, step.source_box, dtype.itemsize)
            np.testing.assert_array_equal(got, as_bytes(np.array(chunk[step.source_box.slices()])))


def test_a_leading_dim_overlap_reads_only_its_rows():
    # rows 2..4 of a (7, 8) float64 chunk: exactly 3 rows of 64 bytes
    assert byte_span((7, 8), Box((2, 0), (3, 8)), 8) == (2 * 64, 5 * 64)
    # a Shard(1)-like column block spans from its first to its last element
    assert byte_span((5, 6), Box((0, 3), (5, 3)), 4) == (3 * 4, (4 * 6 + 5 + 1) * 4)


@pytest.mark.parametrize(("boxes", "reason"), [
    ([Box((0,), (4,)), Box((3,), (4,))], "overlap"),
    ([Box((0,), (4,)), Box((5,), (2,))], "cover 6 of the 7"),
    ([Box((0,), (4,)), Box((4,), (4,))], "outside"),
    ([Box((0, 0), (7, 8)), Box((0, 0), (0, 8))], None),
])
def test_tiling_check_refuses_gaps_overlaps_and_boxes_outside(boxes, reason):
    shape = (7,) if boxes[0].ndim == 1 else (7, 8)
    if reason is None:
        check_tiling(shape, boxes)
        return
    with pytest.raises(ChunkLayoutError, match=reason):
        check_tiling(shape, boxes)


def test_assemble_refuses_a_target_the_saved_chunks_do_not_cover():
    with pytest.raises(ChunkLayoutError, match="cover 4 of the 7"):
        assemble(whole((7,)), [Box((0,), (4,))], lambda i: bytes(32), 8)
