"""The scheduler's state types: actors, leases, steps and their pools, decisions and reason codes."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from deltarl.errors import AdmissionReason as Reason
from deltarl.protocol.records import ActorRecord, LeaseRecord, PromptItem, StepSpec


class LeaseStatus(str, enum.Enum):
    ACTIVE = "active"
    COMMITTING = "committing"
    ADMITTED = "admitted"
    EXPIRED = "expired"
    REVOKED = "revoked"


@dataclass(frozen=True)
class Decision:
    """Outcome of :meth:`Scheduler.begin_admission`."""

    kind: Literal["admit", "duplicate", "reject"]
    lease: LeaseRecord | None = None
    reason: Reason | None = None
    message: str = ""
    key: str | None = None
    at: float = 0.0  # the time of the decision: an admitted record's ``admitted_at``


@dataclass
class ActorState:
    record: ActorRecord
    last_seen: float
    alive: bool = True
    left: bool = False  # stopped cleanly (POST /leave), not silent
    rate: float = 0.0
    measured: bool = False
    last_admit_at: float = float("-inf")
    leases: set[str] = field(default_factory=set)
    admitted_prompts: int = 0
    admitted_tokens: int = 0


@dataclass
class LeaseState:
    record: LeaseRecord
    status: LeaseStatus = LeaseStatus.ACTIVE
    digest: str | None = None
    key: str | None = None
    late_seen: bool = False


class Pool:
    """A step's unleased prompts in lease order, with their sample count kept up to date."""

    def __init__(self, group: dict[str, int]) -> None:
        self._group = group
        self._ids: deque[str] = deque(group)
        self.samples = sum(group.values())

    def __len__(self) -> int:
        return len(self._ids)

    def __bool__(self) -> bool:
        return bool(self._ids)

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __contains__(self, pid: object) -> bool:
        return pid in self._ids

    def peek(self) -> str:
        return self._ids[0]

    def pop(self) -> str:
        pid = self._ids.popleft()
        self.samples -= self._group[pid]
        return pid

    def push_front(self, pids: list[str]) -> None:
        """Return prompts to the front (they are the oldest work)."""
        self._ids.extendleft(reversed(pids))
        self.samples += sum(self._group[p] for p in pids)

    def remove(self, pid: str) -> None:
        self._ids.remove(pid)
        self.samples -= self._group[pid]


@dataclass
class Step:
    spec: StepSpec
    group: dict[str, int]
    pool: Pool
    items: dict[str, PromptItem]
    leased: dict[str, str] = field(default_factory=dict)
    admitted: dict[str, str] = field(default_factory=dict)
    lease_ids: list[str] = field(default_factory=list)
    closed: bool = False

    @property
    def complete(self) -> bool:
        return len(self.admitted) == len(self.group)


def proportional_split(total: int, weights: dict[str, float]) -> dict[str, int]:
    """Split ``total`` items in proportion to ``weights`` (largest remainder; ties by key order)."""
    wsum = sum(max(w, 0.0) for w in weights.values())
    if total <= 0 or wsum <= 0:
        return dict.fromkeys(weights, 0)
    exact = {k: total * max(w, 0.0) / wsum for k, w in weights.items()}
    out = {k: int(v) for k, v in exact.items()}
    rest = total - sum(out.values())
    for k in sorted(exact, key=lambda k: (out[k] - exact[k], k))[:rest]:
        out[k] += 1
    return out
