"""Property tests: every codec round-trips every bit pattern exactly, on both kernel paths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.codec import BF16, bitio, chunk, encode_delta, registry, stage_delta, state_digest
from deltarl.codec.encode import CODECS, encode_chunk
from deltarl.codec.stager import Stager

DTYPES = ["bfloat16", "float16", "float32"]
SPECIAL16 = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x0001, 0x8001, 0x007F, 0x3F80, 0xBF80]
SPECIAL16_FP16 = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF, 0x0001, 0x8001, 0x03FF, 0x3C00]
SPECIAL32 = [
    0,
    0x80000000,
    0x7F800000,
    0xFF800000,
    0x7FC00000,
    0x7F800001,
    0xFFFFFFFF,
    1,
    0x80000001,
    0x3F800000,
]

FIXTURE_OK = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]  # the env var is the same per input
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=FIXTURE_OK)


@pytest.fixture(params=["numba", "numpy"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("DELTARL_NO_NUMBA", "1" if request.param == "numpy" else "0")
    return str(request.param)


def _udt(dtype: str) -> type:
    return np.uint32 if dtype == "float32" else np.uint16


def _wrap(dtype: str, bits: np.ndarray) -> object:
    if dtype == "bfloat16":
        return BF16(bits)
    return bits.view(np.float16 if dtype == "float16" else np.float32)


def _specials(dtype: str) -> list[int]:
    return {"bfloat16": SPECIAL16, "float16": SPECIAL16_FP16, "float32": SPECIAL32}[dtype]


@st.composite
def pairs(draw: st.DrawFn) -> tuple[str, np.ndarray, np.ndarray]:
    """(dtype, old bits, new bits) with specials, sign flips, small and large differences."""
    dtype = draw(st.sampled_from(DTYPES))
    udt = _udt(dtype)
    shape = draw(st.sampled_from([(), (0,), (0, 3), (1,), (7,), (33, 5), (300,), (2, 1500)]))
    n = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    top = np.iinfo(udt).max
    old = rng.integers(0, top, n, dtype=udt, endpoint=True)
    spec = np.array(_specials(dtype), dtype=udt)
    if n:
        sel = rng.random(n) < 0.2
        old[sel] = rng.choice(spec, int(sel.sum()))
    density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 1.0]))
    new = old.copy()
    where = np.flatnonzero(rng.random(n) < density)
    kind = rng.integers(0, 5, where.size)
    small = rng.integers(1, 4, where.size).astype(udt)
    new[where] = np.select(
        [kind == 0, kind == 1, kind == 2, kind == 3],
        [
            old[where] + small,
            old[where] - small,
            old[where] ^ udt(top ^ (top >> 1)),
            rng.choice(spec, where.size),
        ],
        rng.integers(0, top, where.size, dtype=udt, endpoint=True),
    ).astype(udt)
    return dtype, old.reshape(shape), new.reshape(shape)


@SETTINGS
@given(case=pairs(), codec=st.sampled_from(CODECS), segment_bytes=st.sampled_from([1, 5000, 16 << 20]))
def test_round_trip_bit_exact(kernel_path: str, case: tuple, codec: str, segment_bytes: int) -> None:
    dtype, old, new = case
    a, b = {"t": _wrap(dtype, old.copy())}, {"t": _wrap(dtype, new.copy())}
    segs = encode_delta(a, b, base="v", segment_bytes=segment_bytes, codec=codec)
    state = {"t": _wrap(dtype, old.copy())}
    upd = stage_delta(state, segs, base="v")
    assert upd.changed_elements == int((old != new).sum())
    upd.commit()
    upd.commit()
    assert state_digest(state) == state_digest(b)
    upd.rollback()
    assert state_digest(state) == state_digest(a)


@settings(max_examples=15, deadline=None, suppress_health_check=FIXTURE_OK)
@given(case=pairs(), codec=st.sampled_from(CODECS))
def test_numba_and_numpy_paths_agree(monkeypatch: pytest.MonkeyPatch, case: tuple, codec: str) -> None:
    dtype, old, new = case
    a, b = {"t": _wrap(dtype, old)}, {"t": _wrap(dtype, new)}
    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("DELTARL_NO_NUMBA", flag)
        out[flag] = encode_delta(a, b, base="v", codec=codec)
    assert out["0"] == out["1"]
    for flag in ("0", "1"):
        monkeypatch.setenv("DELTARL_NO_NUMBA", flag)
        state = {"t": _wrap(dtype, old.copy())}
        stage_delta(state, out["0"], base="v").commit()
        assert state_digest(state) == state_digest(b)


@pytest.mark.parametrize("codec", ["aurora", "rice", "ctx", "sparse"])
def test_huge_gaps_take_the_escape_path(kernel_path: str, codec: str) -> None:
    n = 1 << 22
    old = np.zeros(n, dtype=np.uint16)
    new = old.copy()
    new[:200] = 1
    new[n - 1] = 0x3F80
    used, changed, payload = encode_chunk(old, new, "bfloat16", codec)
    assert (used, changed) == (codec, 201)
    dec = registry.BY_NAME[codec].decode(old, memoryview(payload), changed)
    order = np.argsort(dec.positions)
    assert dec.positions[order].tolist() == [*range(200), n - 1]
    assert dec.values[order].tolist() == [1] * 200 + [0x3F80]


@settings(max_examples=30, deadline=None, suppress_health_check=FIXTURE_OK)
@given(
    values=st.lists(st.integers(0, 2**64 - 1), max_size=60),
    k=st.integers(0, 32),
    per_value=st.booleans(),
)
def test_rice_streams_round_trip_any_u64(
    kernel_path: str, values: list[int], k: int, per_value: bool
) -> None:
    v = np.array(values, dtype=np.uint64)
    ks = np.arange(v.size, dtype=np.int64) % 33 if per_value else k
    unary, rem, esc = bitio.rice_encode(v, ks)
    assert np.array_equal(bitio.rice_decode(unary, rem, esc, ks, v.size), v)


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.integers(0, 2**64 - 1), max_size=60))
def test_leb128_round_trip(values: list[int]) -> None:
    v = np.array(values, dtype=np.uint64)
    assert np.array_equal(bitio.leb128_decode(bitio.leb128_encode(v), v.size), v)


def test_zigzag_is_a_bijection() -> None:
    d = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    z = chunk.zigzag(d)
    assert np.unique(z).size == 1 << 16
    assert np.array_equal(chunk.unzigzag(z), d)
    assert chunk.zigzag(np.array([1, 0xFFFF], dtype=np.uint16)).tolist() == [2, 1]


def test_rice_k_rule() -> None:
    k = bitio.rice_k(np.array([0, 10, 100, 1000, 2**50]), np.array([0, 1, 1, 1, 1]))
    assert k.tolist() == [0, 3, 7, 10, 32]


def test_ctx_is_smallest_on_adam_like_updates() -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(1 << 18) * 0.02).astype(np.float32)
    step = (rng.standard_normal(w.size) * 3e-6).astype(np.float32)
    bf = lambda x: (x.view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731 - truncation is fine here
    old, new = bf(w), bf(w - step)
    sizes = {c: len(encode_chunk(old, new, "bfloat16", c)[2]) for c in ("aurora", "rice", "dense", "ctx", "sparse")}
    assert min(sizes, key=sizes.__getitem__) == "ctx"
    assert encode_chunk(old, new, "bfloat16", "auto")[0] == "ctx"


@pytest.mark.torch
def test_torch_tensors_round_trip_and_digest_matches_numpy() -> None:
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    a = {
        "w": torch.randn(64, 100, generator=g).bfloat16(),
        "h": torch.randn(300, generator=g).half(),
        "f": torch.randn(5, 7, generator=g),
        "s": torch.tensor(1.5).bfloat16(),
    }
    b = {k: v.clone() for k, v in a.items()}
    b["w"].view(-1)[::13] += 0.05
    b["h"][::7] *= -1
    b["f"][0, 0] = float("nan")
    b["s"].fill_(-0.0)
    state = {k: v.clone() for k, v in a.items()}
    segs = encode_delta(a, b, base="t")
    st_ = Stager(state, base="t")
    for s in segs:
        st_.add_segment(s)
    st_.finish().commit()
    for k in a:
        assert torch.equal(
            state[k].view(torch.int16 if k != "f" else torch.int32),
            b[k].view(state[k].view(torch.int16 if k != "f" else torch.int32).dtype),
        )
    as_numpy = {
        "w": BF16(b["w"].view(torch.int16).numpy().view(np.uint16)),
        "h": b["h"].numpy(),
        "f": b["f"].numpy(),
        "s": BF16(b["s"].view(torch.int16).numpy().view(np.uint16)),
    }
    assert state_digest(state) == state_digest(as_numpy)
