"""Every message that prints two ids (HEAD against a manifest, a broken parent link, a piece or an
object hash) shows them far enough to see where they differ, not two equal 16-character prefixes."""

from __future__ import annotations

import dataclasses

import pytest

from deltarl.errors import IntegrityError, RunError, short_pair
from deltarl.pipeline import RunLayout
from deltarl.pipeline.manifest import HeadRecord, Manifest
from deltarl.pipeline.pieces import PieceVerifier, hash_piece
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.reader import RunReader
from tests.fixtures.runs import publish_run

pytestmark = pytest.mark.torch
LAY = RunLayout("r")


def _near(hex_id: str, at: int = 20) -> str:
    """``hex_id`` with one digit changed at position ``at``: equal in its first ``at`` characters."""
    return hex_id[:at] + ("0" if hex_id[at] != "0" else "1") + hex_id[at + 1 :]


def _shows_both_apart(message: str, a: str, b: str) -> None:
    shown_a, shown_b = short_pair(a, b)
    assert shown_a != shown_b
    assert shown_a in message, message
    assert shown_b in message, message


def test_short_pair_reaches_past_the_first_difference() -> None:
    a = "0123456789abcdef" * 4
    b = _near(a, 30)
    assert short_pair(a, b) == (a[:34] + "…", b[:34] + "…")
    assert short_pair(a, _near(a, 3)) == (a[:16] + "…", _near(a, 3)[:16] + "…")
    assert short_pair(None, a) == ("None", a[:16] + "…")


def test_head_naming_a_near_id_on_resume(memory_store) -> None:
    publish_run(memory_store, "r", 3)
    head = HeadRecord.from_bytes(memory_store.get(LAY.head))
    memory_store.put(LAY.head, dataclasses.replace(head, version_id=_near(head.version_id)).to_bytes())
    with pytest.raises(RunError) as err:
        Publisher(memory_store, "r")
    _shows_both_apart(str(err.value), _near(head.version_id), head.version_id)
    reader = RunReader(memory_store, "r")
    with pytest.raises(RunError) as err:
        reader.check_head(head.version, reader.manifest(head.version)[1])
    _shows_both_apart(str(err.value), _near(head.version_id), head.version_id)


def test_broken_parent_link_to_a_near_id(memory_store) -> None:
    publish_run(memory_store, "r", 3)
    reader = RunReader(memory_store, "r")
    manifest, _ = reader.manifest(2)
    _, parent_id = reader.manifest(1)
    forged = dataclasses.replace(manifest, parent=_near(parent_id))
    memory_store.put(LAY.manifest(2), forged.to_bytes())
    assert Manifest.from_bytes(memory_store.get(LAY.manifest(2))).parent == _near(parent_id)
    with pytest.raises(RunError, match="broken parent chain") as err:
        RunReader(memory_store, "r").chain(2)
    _shows_both_apart(str(err.value), _near(parent_id), parent_id)


def test_piece_hashes_that_share_a_prefix() -> None:
    data = b"x" * 1000
    real = hash_piece(data)
    piece = PieceVerifier("k", len(data), (_near(real, 24),), 1 << 16, "m")
    with pytest.raises(IntegrityError) as err:
        piece.update(data)
    _shows_both_apart(str(err.value), real, _near(real, 24))
