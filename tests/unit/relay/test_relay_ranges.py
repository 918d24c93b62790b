"""Range header parsing and relay config bounds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deltarl import defaults
from deltarl.errors import ConfigError, RangeNotSatisfiable
from deltarl.pipeline.layout import manifest_key_for
from deltarl.relay.config import RelayConfig, RelayProcessConfig
from deltarl.relay.objects import manifest_refs
from deltarl.relay.ranges import parse_range
from tests.fixtures.runs import manifest_naming


@pytest.mark.parametrize(
    ("header", "size", "expected"),
    [
        (None, 10, None),
        ("bytes=0-0", 10, (0, 1)),
        ("bytes=2-5", 10, (2, 6)),
        ("bytes=2-", 10, (2, 10)),
        ("bytes=5-100", 10, (5, 10)),
        ("bytes=-3", 10, (7, 10)),
        ("bytes=-30", 10, (0, 10)),
        ("bytes=2-" + "9" * 5000, 10, (2, 10)),
        ("bytes=-" + "9" * 5000, 10, (0, 10)),
        # RFC 9110: a Range this server does not support is ignored (200, the whole object)
        ("bytes=0-1,3-4", 10, None),
        ("items=0-1", 10, None),
        ("bytes=-", 10, None),
        ("bytes=a-b", 10, None),
    ],
)
def test_parse_range(header: str | None, size: int, expected: tuple[int, int] | None) -> None:
    assert parse_range(header, size) == expected


@pytest.mark.parametrize(
    ("header", "size"),
    [("bytes=10-", 10), ("bytes=11-12", 10), ("bytes=5-2", 10), ("bytes=-0", 10), ("bytes=0-", 0),
     ("bytes=" + "9" * 5000 + "-", 10)],
)
def test_unsatisfiable_ranges(header: str, size: int) -> None:
    with pytest.raises(RangeNotSatisfiable):
        parse_range(header, size)


def test_config_bounds() -> None:
    with pytest.raises(ValidationError, match="cache_dir"):
        RelayConfig(cache_dir="")
    with pytest.raises(ValidationError, match="piece_bytes"):
        RelayConfig(cache_dir="d", piece_bytes=10)
    with pytest.raises(ValidationError, match="token"):
        RelayConfig(cache_dir="d", token="")
    assert RelayConfig(cache_dir="d").cut_through
    assert RelayConfig(cache_dir="d", cache_bytes="2G", piece_bytes="64KiB").cache_bytes == 2 << 30
    with pytest.raises(ConfigError, match="pull_streams"):
        RelayProcessConfig.load(None, None, upstream="memory://x", cache_dir="d", pull_streams=0)
    process = RelayProcessConfig.load(None, None, upstream="memory://x", cache_dir="d")
    assert process.listen == defaults.RELAY_LISTEN
    assert process.listen.rsplit(":", 1)[1] != str(defaults.COORDINATOR_PORT)  # both may run on one host


def test_manifest_lookup_for_keys() -> None:
    seg = "r/versions/000000000042/e000001-seg-r000-00003.bin"
    assert manifest_key_for(seg) == "r/versions/000000000042/manifest.json"
    assert manifest_key_for("r/keyframes/000000000040/e000001-part-r000-000.safetensors") == "r/versions/000000000040/manifest.json"
    assert manifest_key_for("r/versions/000000000042/manifest.json") is None
    assert manifest_key_for("r/HEAD") is None
    key, data = manifest_naming({seg: b"abc"})
    assert key == "r/versions/000000000042/manifest.json"
    refs = manifest_refs(data)  # the pipeline's strict parser: the relay re-states no grammar of its own
    assert list(refs) == [seg]
    assert refs[seg].size == 3
