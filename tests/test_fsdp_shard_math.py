"""fully_shard's pure planning: torch.chunk shard sizes, padding, flat layouts and the copy
helpers."""

from __future__ import annotations

import pytest
import torch

from ringlet.dtensor._shard_math import chunk_sizes
from ringlet.parallel.fsdp._shard_math import (
    copy_in_grads,
    copy_out,
    plan_group,
    shard_of,
)

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("size,world,expected", [
    (33, 2, [17, 16]), (1, 2, [1, 0]), (0, 2, [0, 0]), (5, 4, [2, 2, 1, 0]), (8, 4, [2, 2, 2, 2]),
    (3, 1, [3]), (7, 3, [3, 3, 1]),
])
def test_chunk_units_follow_torch_chunk(size: int, world: int, expected: list[int]) -> None:
    assert chunk_sizes(size, world) == expected
    spec = plan_group([(size, 2)], [0], world).specs[0]
    assert [spec.local_units(r) for r in range(world)] == expected
    pieces = [c.shape[0] for c in torch.arange(size).chunk(world)] if size else []
    assert expected[:len(pieces)] == pieces and sum(expected) == size


def test_chunk_units_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="expected a positive number of shards, got 0"):
        chunk_sizes(4, 0)
    with pytest.raises(ValueError, match="expected a non-negative size, got -1"):
        chunk_sizes(-1, 2)


def test_plan_group_offsets_and_padding() -> None:
    layout = plan_group([(33, 4), (8,), (1,), (0, 3)], [0, 0, 0, 0], 2)
    a, b, c, d = layout.specs
    assert (a.chunk, a.padded_numel, a.shard_offset) == (17, 68, 0)
    assert (b.chunk, b.padded_numel, b.shard_offset) == (4, 4, 68)
    assert (c.chunk, c.local_units(0), c.local_units(1), c.shard_offset) == (1, 1, 0, 72)
    assert (d.padded_numel, d.local_shape(1)) == (0, (0, 3))
    assert layout.shard_numel == 73 and layout.unsharded_numel == 132 + 8 + 1
    assert layout.padding_numel() == 146 - 141
    assert a.local_shape(1) == (16, 4) and a.contiguous_stride() == (4, 1)
    assert [s.unsharded_offset for s in layout.specs] == [0, 132, 140, 141]


def test_plan_group_rejects_scalars_bad_dims_and_uneven_nonzero_dims() -> None:
    with pytest.raises(ValueError, match="scalar"):
        plan_group([()], [0], 2)
    with pytest.raises(ValueError, match="shard dim in"):
        plan_group([(4,)], [1], 2)
    with pytest.raises(ValueError, match="divisible by the world size"):
        plan_group([(4, 3)], [1], 2)
    with pytest.raises(ValueError, match="one dim per shape"):
        plan_group([(4,)], [], 2)


def _round_trip(shapes: list[tuple[int, ...]], dims: list[int], world: int) -> None:
    layout = plan_group(shapes, dims, world)
    fulls = [torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s) + 100 * i
             for i, s in enumerate(shapes)]
    # every rank's shard buffer, then the rank-major gathered buffer
    shard_bufs = []
    for r in range(world):
        buf = torch.full((layout.shard_numel,), -1.0)
        for spec, full in zip(layout.specs, fulls):
            piece = shard_of(full, spec, r).contiguous().reshape(-1)
            buf[spec.shard_offset:spec.shard_offset + piece.numel()] = piece
        shard_bufs.append(buf)
    gathered = torch.cat(shard_bufs)
    unsharded = torch.empty(layout.unsharded_numel)
    copy_out(gathered, unsharded, layout)
    for spec, full in zip(layout.specs, fulls):
        got = unsharded[spec.unsharded_offset:spec.unsharded_offset + spec.numel].view(spec.shape)
        assert torch.equal(got, full), spec
    # reduce-scatter input: rank r's block must hold every param's rank-r shard, zero padded
    rs = torch.full((layout.gathered_numel,), 7.0)
    copy_in_grads(rs, fulls, layout)
    for r in range(world):
        block = rs[r * layout.shard_numel:(r + 1) * layout.shard_numel]
        for spec, full in zip(layout.specs, fulls):
            piece = shard_of(full, spec, r).contiguous().reshape(-1)
            seg = block[spec.shard_offset:spec.shard_offset + spec.padded_numel]
            assert torch.equal(seg[:piece.numel()], piece)
            assert torch.all(seg[piece.numel():] == 0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_copy_out_and_copy_in_grads_round_trip(world: int) -> None:
    _round_trip([(33, 4), (1,), (0, 5), (5, 2, 3), (7,)], [0, 0, 0, 0, 0], world)


def test_round_trip_with_nonzero_shard_dims() -> None:
    _round_trip([(3, 4), (2, 8, 3), (6, 2)], [1, 1, 0], 2)
    _round_trip([(5, 12)], [1], 4)


def test_copy_in_grads_zeroes_missing_grads() -> None:
    layout = plan_group([(4,), (3,)], [0, 0], 2)
    rs = torch.full((layout.gathered_numel,), 9.0)
    copy_in_grads(rs, [None, torch.ones(3)], layout)
    assert rs.tolist() == [0, 0, 1, 1, 0, 0, 1, 0]


def test_shard_of_is_a_view_and_checks_the_shape() -> None:
    layout = plan_group([(5, 2)], [0], 2)
    full = torch.zeros(5, 2)
    piece = shard_of(full, layout.specs[0], 1)
    piece.fill_(1)
    assert full[3:].sum() == 4 and piece.shape == (2, 2)
    with pytest.raises(ValueError, match="shape"):
        shard_of(torch.zeros(4, 2), layout.specs[0], 0)


def test_buffer_pool_reuses_the_smallest_fitting_buffer() -> None:
    from ringlet.parallel.fsdp._collectives import BufferPool

    cpu = torch.device("cpu")
    pool = BufferPool(max_free=2)
    small, big = pool.take(10, torch.float32, cpu), pool.take(20, torch.float32, cpu)
    pool.give(small)
    pool.give(big)
    view = pool.take(5, torch.float32, cpu)
    assert view.numel() == 5 and view._base is small           # best fit, handed out as a prefix
    assert pool.take(15, torch.float32, cpu)._base is big
    assert pool.take(15, torch.float32, cpu)._base is None     # nothing free fits: a new buffer
    assert pool.take(4, torch.float64, cpu).dtype == torch.float64
    pool.give(view)
    assert pool.nbytes() == 40
