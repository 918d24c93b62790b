"""The peers' formats (benchmarks/_peers.py) round-trip exactly, specials and all densities included."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks._peers import PEERS, Peer, round_trip

SPECIAL = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF]


@pytest.mark.parametrize("peer", PEERS, ids=lambda p: p.name)
@pytest.mark.parametrize("density", [0.0, 1e-4, 0.01, 0.3, 1.0])
def test_peer_round_trips_bit_exact(peer: Peer, density: float) -> None:
    rng = np.random.default_rng(int(density * 1e4))
    old = {f"t{i}": rng.integers(0, 1 << 16, n, dtype=np.uint16) for i, n in enumerate([1, 70_000, 300, 5])}
    old["t2"][:10] = SPECIAL
    new = {k: v.copy() for k, v in old.items()}
    for v in new.values():
        hit = rng.random(v.size) < density
        v[hit] = rng.integers(0, 1 << 16, int(hit.sum()), dtype=np.uint16)
        v[hit & (v == 0)] = 0x8000  # +0 -> -0 too
    new["t1"][100:140] ^= np.uint16(0x0040)  # a contiguous run (NeMo-RL's range encoding)
    round_trip(peer, old, new)


def test_round_trip_catches_a_wrong_format() -> None:
    bad = Peer("bad", PEERS[1].encode, lambda state, blob: None)
    old = {"t": np.zeros(10, dtype=np.uint16)}
    with pytest.raises(AssertionError):
        round_trip(bad, old, {"t": np.ones(10, dtype=np.uint16)})
