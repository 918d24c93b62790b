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
    "44524c53050000002e010000cb5b70a50200763028b52ffd601c0105090036923f317045ea808e62b55aad160fadb250"
    "28140ab58680c7e45028140a90e83ff061140a258c68cbb489bbc99d920849db29a514360032002c008ad18b7ab4a316"
    "ade895a3e4e42645194a4d66f2b2789050500e0a12949fc4e4253dd9494b562624080622200220981838d1acc0c40c02"
    "15f555f5967be5d6479efb9ba074ed6839bb59d18656b399bd74a41cdda84843aad1cc82f6b398bdac673b6bd98a82f4"
    "13cddcdcd4ba5b336ed6ec586b8ab1eb89b1e3e61cfb7beeff1ef5defff3c8fb7bb7dc9ff591eaada7acf7ca03520622"
    "aae4200590340c1a1c8ee8504981c17181882a2d24500060361411d883254f8d1bc2ad2766edfad19abbfbd190f60e0c"
    "0043c900f7807c56998bc0b2c643119a4012994032c649bec22d1813002c2140501406a76bc0000630800036c67faa33"
    "a30002e410c0eb7fa68133d40000bc28f000aaf9cfc98a34850156abbe0218c0f59fdc270000ecae7870ffb9320b0008"
    "b658c0eb7fa60230300002132080bf50fe87ec1244400174ac9ffa67e601900191ecbc7efe40c202942d40082080efcf"
    "b9011d4000ba16802ffdcfa4989b1c0006caf6c07c82f33fe7b09c003d95f880d79ff331a00243657cffb9023a140528"
    "53200104308016f99fc9923c100017b1785efb4fe62c0000bd107832fecfc2e81a97a8fc7fa60812ba0000323d9be09b"
    "f99ff41340e000b482f0fd93b331fa0000159100e0ef7fa6285002f65cbcfef38a2c90001ea5f87efa4fe68101e0042b"
    "25c0ff27dc3d000bc2804ffef30200006caf60c00f2a3fbf82a2c00a4ea5fb3ff900b6900002c850cffdcfa4385e0000"
    "0b5080f8e97fb8281000fa2d80db9ff39235f002aecafe20bcfa4fce01b33000020ea080fc42f99fbc031001a9da80df"
    "9fab414600002e41f8eccfb990b1a000bc2ee0fb9fcc92038b002d576ae0f57fe6086a02bb2bc00c60ed4fbe40800501"
    "40116ca080010ce02d00e3cfb9093d9000084c88f0f73fcb1a848501574ae080000670fa3fc902480000c8f600f0da9f"
    "fc15c02d42e03fbf1b0790000ba1607efd9fa4b0bd60000d95e99ef63fd982fe0001ecaf40c0df9ffc013d0024365080"
    "ef4fbe1b8880014c94fc0af93fc9921dc17b16c0ff3fc908017a28e07efe81e30001a97a80f8ea0fbf12b01ac000323d"
    "92c0cff93ff4182d10005a46802ffd4fb23954015900fccfb907200017b2f080cf7efe902341003d4bec8047fb9fa7a0"
    "c15000856400e0f53fd9080000bc2c3c34fefc01a6003657b0c0f727d79940800054a4ea0040784af23fe91a02100059"
    "0b80f0fd9fa40ca000016a10e0b39f9f08238fa2e8f0fa27fc99834a0001d95ea03efb3fb32300a001075040dfffb9fc"
    "7750d7"
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
    full = _ctxs5.pack(changed, *args, pops, rix, rec.k_pos, rec.k_big_val, rec.k_n, rec.shares(), rec.cbits)
    assert full.tobytes() == payload
    never = rec.k_pos.copy()
    never[never == 0] = 1  # no class may be coded by its unchanged elements
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
