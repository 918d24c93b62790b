"""8-bit elements (float8_e4m3fn, float8_e5m2) through every codec: all 256 patterns, golden bytes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.codec import apply_delta, encode_delta, read_segment_header, stage_delta, state_digest
from deltarl.codec.classes import CLASS_FIELDS
from deltarl.codec.finite import nonfinite_bits

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
CODECS = ["auto", "aurora", "rice", "dense", "ctx", "sparse", "ctxs"]
BASE = "b" * 64


@pytest.fixture(params=["numba", "numpy"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("DELTARL_NO_NUMBA", "1" if request.param == "numpy" else "0")
    return str(request.param)


def _fp8(dtype: str, bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint8, copy=True)).view(FP8[dtype])


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy().copy()


def _round_trip(dtype: str, old: np.ndarray, new: np.ndarray, codec: str, segment_bytes: int = 16 << 20) -> list[bytes]:
    a, b = {"w": _fp8(dtype, old)}, {"w": _fp8(dtype, new)}
    segs = encode_delta(a, b, base=BASE, codec=codec, segment_bytes=segment_bytes)
    state = {"w": a["w"].clone()}
    staged = stage_delta(state, segs, base=BASE)
    staged.commit()
    assert np.array_equal(_bits(state["w"]), new)
    staged.rollback()
    assert np.array_equal(_bits(state["w"]), old)
    return segs


@pytest.mark.parametrize("dtype", sorted(FP8))
@pytest.mark.parametrize("codec", CODECS)
def test_every_pattern_to_every_pattern(dtype: str, codec: str, kernel_path: str) -> None:
    """All 256 x 256 (old, new) pairs of 8-bit patterns: NaN encodings, +-0, subnormals, +-max."""
    old = np.repeat(np.arange(256, dtype=np.uint8), 256)
    new = np.tile(np.arange(256, dtype=np.uint8), 256)
    segs = _round_trip(dtype, old, new, codec, segment_bytes=4096)
    assert sum(c.changed for s in segs for c in read_segment_header(s).chunks) == 256 * 255


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(sorted(FP8)),
    codec=st.sampled_from(CODECS),
    data=st.data(),
)
def test_random_densities_round_trip(dtype: str, codec: str, data: st.DataObject, kernel_path: str) -> None:
    n = data.draw(st.integers(0, 5000))
    old = np.array(data.draw(st.lists(st.integers(0, 255), min_size=n, max_size=n)), dtype=np.uint8)
    density = data.draw(st.sampled_from([0.0, 0.001, 0.02, 0.5, 1.0]))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    new = old.copy()
    hit = rng.random(n) < density
    step = rng.choice(np.array([1, 255, 2, 254, 128], dtype=np.uint8), size=n)  # +-1 codes mostly, sign flips
    new[hit] = old[hit] + step[hit]
    _round_trip(dtype, old, new, codec, segment_bytes=data.draw(st.sampled_from([1, 4096, 16 << 20])))


def test_ctx_classes_are_the_exponent_fields() -> None:
    assert CLASS_FIELDS["float8_e4m3fn"] == (3, 4)  # S.EEEE.MMM
    assert CLASS_FIELDS["float8_e5m2"] == (2, 5)  # S.EEEEE.MM


def test_nonfinite_patterns() -> None:
    every = np.arange(256, dtype=np.uint8)
    assert nonfinite_bits(every, "float8_e4m3fn") == 2  # 0x7F and 0xFF, the only NaNs of e4m3fn
    assert nonfinite_bits(every, "float8_e5m2") == 8  # exponent 11111: +-inf and 3 NaNs each
    ref = torch.from_numpy(every).view(torch.float8_e5m2).float()
    assert int((~torch.isfinite(ref)).sum()) == 8


def test_digest_of_fp8_matches_its_bytes() -> None:
    bits = np.arange(256, dtype=np.uint8)
    a = state_digest({"w": _fp8("float8_e4m3fn", bits)})
    assert a == state_digest({"w": _fp8("float8_e4m3fn", bits.copy())})
    assert a != state_digest({"w": _fp8("float8_e5m2", bits)})  # the dtype code is in the table


# An e4m3 delta: codes 0..255 with six changed (3->4, 40->39, 41->43, 127(NaN)->0, 200->128, 255(NaN)->127).
_OLD = np.arange(256, dtype=np.uint8)
_NEW = _OLD.copy()
_NEW[[3, 40, 41, 127, 200, 255]] = [4, 39, 43, 0, 128, 127]
GOLDEN = {
    ("float8_e4m3fn", "ctx"): "44524c5302000000640000007761e0bb400062626262626262626262626262626262626262626262626262626262626262626262"
    "62626262626262626262626262626262626262626262626262626262626201000000000001007704010001000000000000010000"
    "00070000000004008002062e030418020100010000010300010001000001000500000002010903000601010f020007020275408f"
    "78b81befe05cb2215264",
    ("float8_e4m3fn", "sparse"): "44524c53020000006400000043af03e0400062626262626262626262626262626262626262626262626262626262626262626262"
    "62626262626262626262626262626262626262626262626262626262626201000000000001007704010001000000000000010000"
    "000700000000050080020621050006040000000000000002040001000001030001b250190154583caa03d1be5cf4944dce",
    ("float8_e5m2", "ctx"): "44524c53020000006400000079f16b1e400062626262626262626262626262626262626262626262626262626262626262626262"
    "62626262626262626262626262626262626262626262626262626262626201000000000001007705010001000000000000010000"
    "00070000000004008002062e020518020100010000010300010001000001000a00000002011201000601011f010007020272a0b0"
    "78b81befe05c05525332",
}


@pytest.mark.parametrize(("dtype", "codec"), sorted(GOLDEN))
def test_golden_bytes(dtype: str, codec: str) -> None:
    seg = encode_delta({"w": _fp8(dtype, _OLD)}, {"w": _fp8(dtype, _NEW)}, base=BASE, codec=codec)
    assert [s.hex() for s in seg] == [GOLDEN[dtype, codec]]
    table = read_segment_header(seg[0]).tensors
    assert [(t.name, t.dtype, t.shape) for t in table] == [("w", dtype, (256,))]
    state = {"w": _fp8(dtype, _OLD)}
    apply_delta(state, [bytes.fromhex(GOLDEN[dtype, codec])], base=BASE)
    assert np.array_equal(_bits(state["w"]), _NEW)


def test_warm_up_covers_8_bit_codes() -> None:
    from deltarl.codec.jit_warmup import warm_codec

    warm_codec(["float8_e4m3fn", "float8_e5m2"])  # encodes, stages, commits and rolls back 8-bit deltas


@pytest.mark.parametrize("dtype", sorted(FP8))
def test_torch_scatter_path_commits_and_rolls_back_8_bit(dtype: str) -> None:
    """The device path (CUDA tensors, or CPU tensors with ``torch_scatter=True``) batches 8-bit bits too."""
    old = np.repeat(np.arange(256, dtype=np.uint8), 4)
    new = old.copy()
    new[::3] += 1
    a = {"w": _fp8(dtype, old), "s": torch.arange(8, dtype=torch.float32)}
    b = {"w": _fp8(dtype, new), "s": a["s"] + 1}
    segs = encode_delta(a, b, base=BASE)
    state = {k: v.clone() for k, v in a.items()}
    staged = stage_delta(state, segs, base=BASE, torch_scatter=True)
    staged.commit()
    assert np.array_equal(_bits(state["w"]), new)
    assert torch.equal(state["s"], b["s"])
    staged.rollback()
    assert np.array_equal(_bits(state["w"]), old)
    assert torch.equal(state["s"], a["s"])
