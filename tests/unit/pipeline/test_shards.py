"""Row shards without a process group: per-shard encoding composes into one delta, the rank-by-rank
digest equals the whole-state one, coverage checks name gaps and overlaps, part files are standard
safetensors with their ranges."""

from __future__ import annotations

import pytest

from deltarl.codec import apply_delta, encode_delta, read_segment_header
from deltarl.codec.encode import iter_encode_rows
from deltarl.codec.tensors import state_digest, tensor_table
from deltarl.errors import IntegrityError, TensorMismatch
from deltarl.pipeline import shard_rows as sr
from deltarl.pipeline.shard_digest import combine_digest, shard_hashes

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
BASE = "b" * 64


def _states(seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    old = {
        "embed": torch.randn(259, 96, generator=g).bfloat16(),
        "norm": torch.randn(7, generator=g),
        "empty": torch.zeros(0, 4).bfloat16(),
        "wide": torch.randn(33, 1030, generator=g).bfloat16(),
    }
    new = {}
    for name, t in old.items():
        mask = torch.rand(t.shape, generator=g) < 0.05
        new[name] = torch.where(mask, t * 1.01 + 1e-3, t).to(t.dtype)
    return old, new


def _shard(state: dict, rank: int, world: int) -> tuple[dict, sr.Rows]:
    triples = {}
    for name, t in state.items():
        per = -(-t.shape[0] // world) if t.shape[0] else 0
        start = min(per * rank, t.shape[0])
        stop = min(start + per, t.shape[0])
        triples[name] = (t[start:stop].clone(), tuple(t.shape), start)
    return sr.local_rows(triples)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shard_segments_compose_into_one_delta(world: int) -> None:
    old, new = _states()
    segments, chunks = [], []
    for rank in range(world):
        o, rows = _shard(old, rank, world)
        n, _ = _shard(new, rank, world)
        for seg in iter_encode_rows(o, n, rows, base=BASE, segment_bytes=4096, threads=1):
            header = read_segment_header(seg)
            assert header.base == BASE
            chunks += [(c.tensor, c.start, c.count) for c in header.chunks]
            segments.append(seg)
    sr.check_cover(tensor_table(old), chunks, "delta")
    state = {k: v.clone() for k, v in old.items()}
    apply_delta(state, segments, base=BASE)
    for name in old:
        assert torch.equal(state[name].view(torch.uint8), new[name].view(torch.uint8)) if state[name].numel() else True
    whole = sum(len(s) for s in encode_delta(old, new, base=BASE, segment_bytes=4096))
    assert sum(len(s) for s in segments) <= whole * 1.15 + 200 * world


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_rank_by_rank_digest_equals_whole_state(world: int) -> None:
    old, _ = _states(1)
    table = tensor_table(old)
    shares = [shard_hashes(*_shard(old, r, world)) for r in range(world)]
    assert combine_digest(table, shares) == state_digest(old)  # what an actor computes
    with pytest.raises(IntegrityError, match=r"not covered|ends at byte"):
        combine_digest(table, shares[:-1] if world > 1 else [{}])
    if world > 1:
        with pytest.raises(IntegrityError, match=r"two shards|gap or overlap|both whole"):
            combine_digest(table, [*shares, shares[0]])


def test_check_cover_names_gap_and_overlap() -> None:
    table = tensor_table({"w": torch.zeros(4, 3)})
    sr.check_cover(table, [("w", 0, 6), ("w", 6, 6)], "x")
    with pytest.raises(IntegrityError, match="gap in 'w' at element 6"):
        sr.check_cover(table, [("w", 0, 6), ("w", 7, 5)], "x")
    with pytest.raises(IntegrityError, match="overlap in 'w' at element 5"):
        sr.check_cover(table, [("w", 0, 6), ("w", 5, 7)], "x")
    with pytest.raises(IntegrityError, match="covered up to element 6 of 12"):
        sr.check_cover(table, [("w", 0, 6)], "x")
    with pytest.raises(IntegrityError, match="'v' is not in"):
        sr.check_cover(table, [("v", 0, 1)], "x")


def test_local_rows_rejects_what_is_not_a_row_shard() -> None:
    with pytest.raises(TensorMismatch, match="not a row shard"):
        sr.local_rows({"w": (torch.zeros(2, 3), (4, 4), 0)})
    with pytest.raises(TensorMismatch, match="not a row shard"):
        sr.local_rows({"w": (torch.zeros(2, 3), (4, 3), 3)})
    with pytest.raises(TensorMismatch, match="row offset"):
        sr.local_rows({"w": (torch.zeros(2, 3), (4, 3), -1)})
    _, rows = sr.local_rows({"w": (torch.zeros(2, 3), (4, 3), 2)})
    assert rows["w"][1] == 6


def test_iter_encode_rows_rejects_a_shard_past_the_tensor() -> None:
    old = {"w": torch.zeros(2, 3).bfloat16()}
    spec = tensor_table({"w": torch.zeros(4, 3).bfloat16()})[0]
    with pytest.raises(TensorMismatch, match="does not fit"):
        list(iter_encode_rows(old, old, {"w": (spec, 7)}, base=BASE))


def test_keyframe_parts_are_safetensors_with_ranges() -> None:
    from safetensors.torch import load

    old, _ = _states()
    local, rows = _shard(old, 1, 2)
    plan = sr.plan_local_parts(local, rows, part_bytes=20000)
    assert len(plan) > 1
    assert [r for part in plan for r in part] == sr.held_ranges(local, rows)
    for ranges in plan:
        data = b"".join(bytes(b) for b in sr.iter_local_part(local, rows, ranges, chunk=1000))
        got = load(data)  # a standard safetensors file
        assert sorted(got) == sorted(name for name, _, _ in ranges)
        for name, start, count in ranges:
            assert torch.equal(got[name].reshape(-1), old[name].reshape(-1)[start : start + count])
