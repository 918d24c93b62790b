"""What the demo's deltas mean: the seed's LEB128 codec on the same versions, and an estimate at 8B.

:class:`AuroraCounting` wraps the trainer's publisher: before each version is published it encodes
the same delta (previous export -> this export) with the ``aurora`` codec (LEB128 gaps and raw
values, the scheme deltarl started from) and records its size, so the live view and the report can
show what the published codec saves. At demo size that is a few milliseconds per version.

:func:`scale_estimate` turns the run's measured bytes per changed element into the time one version
of an 8B-parameter model would take over a 1 Gbit/s link, full BF16 against deltarl at the run's
changed fraction. It is an estimate: real models' update statistics differ from the demo's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltarl.pipeline.publisher import Publisher

log = logging.getLogger(__name__)

#: The model size and link of the end-of-run estimate.
ESTIMATE_PARAMS = 8_000_000_000
ESTIMATE_LINK_BITS_PER_S = 1e9


class AuroraCounting:
    """A publisher wrapper that also counts what the ``aurora`` codec would ship for each version."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        #: version -> bytes of the aurora-encoded delta from the version before
        self.aurora_bytes: dict[int, int] = {}
        self._prev: Mapping[str, Any] | None = None
        self._prev_id: str | None = None
        self._pending: int | None = None
        self._in_flight = False

    @property
    def next_version(self) -> int:
        return int(self.inner.next_version)

    def _count(self, state_dict: Mapping[str, Any]) -> int | None:
        """Bytes of the aurora-encoded delta from the last published state to ``state_dict``."""
        from deltarl.codec.encode import iter_encode_delta

        if self._prev is None:
            return None
        segment_bytes = self.inner.config.segment_bytes
        base = self._prev_id or "0" * 64  # only its length matters to the byte count
        return sum(len(seg) for seg in iter_encode_delta(self._prev, state_dict, base=base,
                                                          segment_bytes=segment_bytes, codec="aurora"))

    def _published(self, state_dict: Mapping[str, Any], owned: bool) -> None:
        # an owned export is never modified again (the publisher's contract), so a reference is enough
        self._prev = state_dict if owned else {k: v.clone() for k, v in state_dict.items()}

    def _settled(self, info: Any, count: int | None) -> Any:
        if info is not None:
            if count is not None:
                self.aurora_bytes[info.version] = count
            self._prev_id = info.version_id
        return info

    def publish(self, state_dict: Mapping[str, Any], step: int, *, owned: bool = False) -> Any:
        count = self._count(state_dict)
        info = self.inner.publish(state_dict, step, owned=owned)
        self._published(state_dict, owned)
        return self._settled(info, count)

    def publish_async(self, state_dict: Mapping[str, Any], step: int, *, owned: bool = False) -> Any:
        """Count, then hand over to the publisher's background lane; :meth:`wait` records the count."""
        self.wait()  # one in flight, as the publisher itself
        self._pending = self._count(state_dict)
        fut = self.inner.publish_async(state_dict, step, owned=owned)
        self._published(state_dict, owned)
        self._in_flight = True
        return fut

    def wait(self) -> Any:
        if not self._in_flight:
            return None
        self._in_flight = False
        return self._settled(self.inner.wait(), self._pending)


@dataclass(frozen=True)
class ScaleEstimate:
    """One version of an ``params``-parameter BF16 model over a link of ``link_bits_per_s``."""

    params: int
    link_bits_per_s: float
    changed_fraction: float
    bytes_per_changed: float

    @property
    def full_bytes(self) -> float:
        return 2.0 * self.params

    @property
    def delta_bytes(self) -> float:
        return self.params * self.changed_fraction * self.bytes_per_changed

    @property
    def full_s(self) -> float:
        return self.full_bytes * 8 / self.link_bits_per_s

    @property
    def delta_s(self) -> float:
        return self.delta_bytes * 8 / self.link_bits_per_s

    def line(self) -> str:
        """The one-line summary the demo prints at the end."""
        return (f"estimate for an {self.params / 1e9:.0f}B model over a {self.link_bits_per_s / 1e9:g} Gbit/s link: "
                f"full BF16 {self.full_bytes / 1e9:.1f} GB = {self.full_s:.0f} s per version; deltarl at this run's "
                f"{self.changed_fraction:.1%} changed x {self.bytes_per_changed:.2f} B per changed element "
                f"= {self.delta_bytes / 1e9:.2f} GB = {self.delta_s:.1f} s per version "
                f"({self.full_s / max(self.delta_s, 1e-9):.0f}x less; an estimate from this run's measured bytes)")

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "link_bits_per_s": self.link_bits_per_s, "changed_fraction": self.changed_fraction,
                "bytes_per_changed": self.bytes_per_changed, "full_s": self.full_s, "delta_s": self.delta_s}


def scale_estimate(changed_elements: Sequence[int], total_elements: Sequence[int], delta_bytes: Sequence[int], *,
                   params: int = ESTIMATE_PARAMS, link_bits_per_s: float = ESTIMATE_LINK_BITS_PER_S) -> ScaleEstimate | None:
    """The estimate from a run's delta versions (one entry per version); None without a changed element."""
    changed = sum(changed_elements)
    if changed == 0 or not total_elements:
        return None
    fraction = sum(c / t for c, t in zip(changed_elements, total_elements, strict=True) if t) / len(total_elements)
    return ScaleEstimate(params, link_bits_per_s, fraction, sum(delta_bytes) / changed)
