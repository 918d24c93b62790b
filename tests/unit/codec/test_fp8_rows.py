"""Block-FP8 quantization of row shards: the max of every shard's block maxima is the whole weight's,
and each shard's codes under the whole weight's scales are the whole weight's codes, bit for bit,
for any split of the rows (not aligned to 128, uneven, with empty shards)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.codec import fp8
from deltarl.codec.fp8 import BLOCK, block_amax, block_scales, quantize_rows, quantize_weight
from deltarl.errors import NonFiniteTensor

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


def _u8(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@st.composite
def split_weights(draw: st.DrawFn) -> tuple[torch.Tensor, list[int], int]:
    rows = draw(st.integers(1, 400))
    cols = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.sampled_from([1e-6, 0.02, 3.0, 1e4]))
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * spread).to(draw(st.sampled_from([torch.bfloat16, torch.float32])))
    cuts = sorted(draw(st.lists(st.integers(0, rows), max_size=4)))
    slice_elements = draw(st.sampled_from([1, 40_000, fp8.SLICE_ELEMENTS]))  # 1: one block row a slice
    return w, [0, *cuts, rows], slice_elements


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_weights())
def test_shards_give_the_whole_weights_scales_and_codes(case: tuple[torch.Tensor, list[int], int]) -> None:
    w, bounds, slice_elements = case
    want_codes, want_scale = quantize_weight("w", w)  # the whole weight in one slice (<= 400 x 300)
    amax = torch.zeros_like(want_scale)
    for lo, hi in pairwise(bounds):
        if hi > lo:
            part = block_amax(w[lo:hi], row0=lo)
            b0 = lo // BLOCK
            amax[b0 : b0 + part.shape[0]] = torch.maximum(amax[b0 : b0 + part.shape[0]], part)
    scale = block_scales("w", amax)
    assert _u8(scale) == _u8(want_scale)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8, "SLICE_ELEMENTS", slice_elements)
        codes = [quantize_rows(w[lo:hi], scale, row0=lo) for lo, hi in pairwise(bounds)]
    assert [tuple(c.shape) for c in codes] == [(hi - lo, w.shape[1]) for lo, hi in pairwise(bounds)]
    assert _u8(torch.cat(codes)) == _u8(want_codes)


def test_a_shards_block_maxima_cover_only_the_block_rows_it_touches() -> None:
    w = torch.zeros(300, 130)
    w[129, 129] = -5.0
    part = block_amax(w[100:200], row0=100)  # rows 100..199 touch block rows 0 and 1
    assert part.shape == (2, 2)
    assert part.tolist() == [[0.0, 0.0], [0.0, 5.0]]
    w[150, 0] = float("nan")
    with pytest.raises(NonFiniteTensor, match="'w'"):
        block_scales("w", block_amax(w[100:200], row0=100))
