"""Segment format 5: format 4's header with class records that carry shares, and ``ctxs`` payloads
coded against them (counts against each class's share of the chunk's changes, saturated classes by
their unchanged elements, one sequence of large values, no stream lengths). Golden bytes, the same
bytes from the numba and the Python coder, and corrupt payloads refused as FormatErrors on both."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.codec import BF16, _ctxs5, encode_delta, kernels, read_segment_header, stage_delta
from deltarl.codec import delta_layout as layout
from deltarl.codec.chunk import Changes
from deltarl.codec.classes import rank_classes
from deltarl.codec.ctxs import LAYOUT_SHARES, decode, encode
from deltarl.errors import FormatError

# A 64 x 64 bfloat16 tensor, 64 cells of 64 elements (cells from 1 change): weights of exponents
# 0x70..0x7F; those below 0x74 (tiny: an RL step moves each of them) all change, the others one in
# 19; +-1 ulp, one in 7 by 2, one in 97 by 300 (escaped: above 40 << k).
GOLDEN_V5 = (
    "44524c5305000000310100001dae1f300200763028b52ffd6024011d090066d23f317045ea808e62b55aad160fadb250"
    "28140ab58680c7e45028140a90e83ff061140a258c68cbb4d36eb2654a22646b29a514370032002c001fc5e8453dda51"
    "8b56f4ca51727293a20ca5263379593c482828070509ca4f62f2929eeca4252b13120403111001114c0c9c6856606206"
    "950b54d357d55bee955b4f3df737c1c6b5a3e5ec66451b5acd66f6d2917274a3220da946330bdacf62f6b29eedac652b"
    "0ad2edddcccdb9d6dd9a71336689b59e18bb768c1d3749627fcffddf9bdefb7f4ebdbf77cbfd594f556ffd64bd078848"
    "3532101d1a0110258838390cf0d1e0f850604044f7b8405c48a00048070283b0e46ecc116eed98b5d410d6dcdd908e04"
    "0d002014b8041064a10b13bc08d0703c14a10924910924639ce42bdc823101c0024140501406a76bc0000630800036c6"
    "7faa55a30002e410c0eb7fa684ef500002f0a0f000aaf9cfc995790a02ad577c0218c0f59fdc470000ecae7870ffb954"
    "0b0008b658c0eb7fa60570c000084c82bf50fe87ec25888002e9589ffa67e601900191ecbc7efe60c202942d40082080"
    "efcfb904950002e858802ffdcfa4b2dce0003657b67c82f33fe7d09c003d95f880d79ff351a00243657cffb90884280a"
    "50a6400104308016f99fc9a58820002f62f05efb4fe64c0000bd107832fecfe4e81a97a8fc7fa6106ce80000c8f66ce0"
    "9bf99ff42781c0016904f0fd93b353f400002b22e0ef7fa6485002f65cbcfef3956920003d4bf07efa4fe683098010ac"
    "94c0ff27dc5d000bc2804ffef30200006caf60c00f2a3fbf895680149d4afb3ff902fa40000b2140cffdcfa458bc0000"
    "16a100f8e97fb8481000fa2d80db9ff3a57be0055d95fc20bcfa4fce06eec000083a82fc42f99fbc06200353b500df9f"
    "ab614600002e41f8eccfb9a2e68002f0b8e0fb9fcca8102c00b55da8e0f57fe6106a02bb2bc00c60ed4fbe6080050140"
    "116ca080010ce02d00e3cfb915164000213220f0f73fcb391214055d2b8080000670fa3fc90490000191ec00f0da9ffc"
    "15c02d42e03fbf3a1e40002e85807efd9fa4d18ac0001b2bd29ef63fd985fc0003d95e80c0df9ffc027a00486ca080ef"
    "4fbe3b2200053250fc0af93fc9a87705ec5bff3fc908017a28e07efe81e30001a97a80f8ea0fbf29706b0000c8f648c0"
    "cff93ff430d440016918802ffd4fb25954015900fccfb907200017b2f080cf7efea10f0400f52fb08047fb9fa7c192a0"
    "010ac800e0f53fd9100000bc2c3c34fefc034c006caf60c0f727d7b52200015293a80040784af23fe938084001642ef0"
    "fd9fa40ca000016a10e0b39f9f10471f45d0f0fa27fcb61e50000ecaf53efb3fb3450140020ea080dfffb9fe247273"
)


def _pair() -> tuple[np.ndarray, np.ndarray]:
    i = np.arange(64 * 64, dtype=np.int64)
    exp = 0x70 + (i * 2654435761 >> 7) % 16
    old = ((exp << 7) | (i * 40503 % 128)).astype(np.uint16)
    hit = (exp < 0x74) | ((i * 7919) % 19 == 0)
    step = np.where(i % 97 == 0, 300, np.where(i % 7 == 0, 2, 1)) * np.where(i % 2 == 0, 1, -1)
    new = np.where(hit, old.astype(np.int64) + step, old).astype(np.uint16)
    return old.reshape(64, 64), new.reshape(64, 64)


def _encode(monkeypatch: pytest.MonkeyPatch) -> bytes:
    monkeypatch.setattr(layout, "TILE_MIN_ELEMENTS", 1)
    monkeypatch.setattr(layout, "CELL_MIN_CHANGES", 1)
    old, new = _pair()
    (seg,) = encode_delta({"w": BF16(old)}, {"w": BF16(new)}, base="v0", codec="ctxs")
    return seg


def test_golden_format5_reads_and_stages() -> None:
    seg = bytes.fromhex(GOLDEN_V5)
    h = read_segment_header(seg)
    assert h.format_version == 5
    assert h.classes["w"].layout == LAYOUT_SHARES
    assert sorted(c.cell for c in h.chunks) == list(range(64))
    assert all(c.codec == "ctxs" and c.count == 64 for c in h.chunks)
    old, new = _pair()
    state = {"w": BF16(old.copy())}
    stage_delta(state, [seg], base="v0").commit()
    assert np.array_equal(state["w"].bits, new)


@pytest.mark.parametrize("numpy_path", [False, True])
def test_writer_gives_the_golden_table_and_payloads(numpy_path: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The frame's bytes are the zstd library's; what it holds, and every payload byte, are ours."""
    from deltarl.codec.segment import _inflate

    monkeypatch.setenv("DELTARL_NO_NUMBA", "1" if numpy_path else "0")
    seg, gold = _encode(monkeypatch), bytes.fromhex(GOLDEN_V5)
    a, b = read_segment_header(seg), read_segment_header(gold)
    assert a.format_version == 5
    assert seg[a.payload_offset : -4] == gold[b.payload_offset : -4]
    assert _inflate(memoryview(seg)[20 : a.payload_offset]) == _inflate(memoryview(gold)[20 : b.payload_offset])


def _cell_payloads() -> list[tuple[np.ndarray, np.ndarray, bytes, int]]:
    """(old, new, payload, changed) of the golden segment's cells."""
    seg = bytes.fromhex(GOLDEN_V5)
    h = read_segment_header(seg)
    old, new = _pair()
    out, off = [], h.payload_offset
    from deltarl.codec.grid import Grid

    g = Grid(old.shape)
    for c in h.chunks:
        r0, r1, c0, c1 = g.rect(c.cell)
        out.append((old[r0:r1, c0:c1].reshape(-1), new[r0:r1, c0:c1].reshape(-1), seg[off : off + c.nbytes], c.changed))
        off += c.nbytes
    return out


def test_saturated_classes_are_coded_by_their_unchanged_elements() -> None:
    """A cell's classes that every element of changes cost a bit or two, not a bit a change."""
    rec = read_segment_header(bytes.fromhex(GOLDEN_V5)).classes["w"]
    old, new, payload, changed = _cell_payloads()[0]
    rix = np.full(1 << rec.cbits, -1, np.int64)
    rix[rec.classes] = np.arange(rec.classes.size)
    code = rank_classes(old, new, "bfloat16", field=(rec.shift, rec.cbits))
    pops = np.bincount(kernels.classes(old, rec.shift, (1 << rec.cbits) - 1), minlength=1 << rec.cbits)
    args = (code.active, code.counts, code.n_big, code.k_pos, code.k_bv, code.gaps.astype(np.int64),
            code.big_gaps.astype(np.int64), code.big_vals.astype(np.int64), code.neg.astype(np.uint8))  # fmt: skip
    full = _ctxs5.pack(changed, *args, pops, rix, rec.rank_param(), rec.k_big_val, rec.k_n, rec.shares(), rec.cbits)
    assert full.tobytes() == payload
    never = rec.rank_param().copy()
    never[never == 1] = 2  # no class may be coded by its unchanged elements
    plain = _ctxs5.pack(changed, *args, pops, rix, never, rec.k_big_val, rec.k_n, rec.shares(), rec.cbits)
    saturated = sum(int(n) for c, n in zip(code.active, code.counts, strict=True) if pops[c] == n)
    assert saturated >= 8
    assert plain.size * 8 >= full.size * 8 + saturated // 2


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_corrupt_payload_is_a_format_error_on_both_paths(data: st.DataObject, monkeypatch: pytest.MonkeyPatch) -> None:
    """Flipped bits, truncated or extended payloads and forged change counts: either a FormatError
    or a decode, the same on the numba and the Python path (the segment's hashes catch the rest)."""
    rec = read_segment_header(bytes.fromhex(GOLDEN_V5)).classes["w"]
    cells = _cell_payloads()
    old, _, payload, changed = cells[data.draw(st.integers(0, len(cells) - 1))]
    bad = bytearray(payload)
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "changed"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            bit = data.draw(st.integers(0, 8 * len(bad) - 1))
            bad[bit // 8] ^= 0x80 >> (bit % 8)
    elif how == "truncate":
        bad = bad[: data.draw(st.integers(0, len(bad) - 1))]
    elif how == "extend":
        bad += bytes(data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=9)))
    else:
        changed = data.draw(st.integers(1, 64).filter(lambda n: n != changed))
    results = []
    for flag in ("0", "1"):
        monkeypatch.setenv("DELTARL_NO_NUMBA", flag)
        try:
            dec = decode(old, memoryview(bytes(bad)), changed, rec)
            order = np.argsort(dec.positions)
            results.append((dec.positions[order].tolist(), dec.values[order].tolist()))
        except FormatError as err:
            results.append(str(err))
    assert results[0] == results[1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), tiny=st.sampled_from([0.0, 0.3, 0.9]), density=st.sampled_from([0.01, 0.2]))
def test_numba_and_python_write_the_same_payload(seed: int, tiny: float, density: float,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    rng = np.random.default_rng(seed)
    n = 600
    exp = np.where(rng.random(n) < tiny, 0x60, 0x78) + rng.integers(0, 6, n)
    old = ((exp << 7) | rng.integers(0, 128, n)).astype(np.uint16)
    hit = (exp < 0x70) | (rng.random(n) < density)
    new = np.where(hit, old.astype(np.int64) + rng.choice([-2, -1, 1, 1, 500], n), old).astype(np.uint16)
    from deltarl.codec.ctxs import choose_record

    rec = choose_record(old[: n // 2], new[: n // 2], "bfloat16", n, (8, 7))  # missing classes: extras
    payloads = []
    for flag in ("0", "1"):
        monkeypatch.setenv("DELTARL_NO_NUMBA", flag)
        code = rank_classes(old, new, "bfloat16", field=(rec.shift, rec.cbits))
        if not code.pos.size:
            return
        payloads.append(encode(old, new, "bfloat16", Changes(code.pos, code), rec))
        dec = decode(old, memoryview(payloads[-1]), code.pos.size, rec)
        assert np.array_equal(np.sort(dec.positions), np.flatnonzero(old != new))
    assert payloads[0] == payloads[1]
