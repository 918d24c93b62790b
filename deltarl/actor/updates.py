"""What the subscriber stages and commits: a delta's StagedUpdate, or a whole state (a catch-up),
and the record of each commit.

* :class:`FullUpdate` - a catch-up (keyframe + deltas) swapped into the live tensors, undoable, in
  two copies of the state, never three;
* :class:`InPlace` - a first bootstrap that loaded straight into the live tensors (nothing to write);
* :class:`Staged` - one version ready to commit; :class:`DigestCheck` - a committed version whose
  state digest is being computed off the pause; :class:`CommitInfo` - what a commit did.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from deltarl.codec.tensors import TensorSpec
from deltarl.errors import StagingError
from deltarl.pipeline.manifest import Manifest


@dataclass(frozen=True)
class CommitInfo:
    """What one commit did, for logs and metrics."""

    version: int
    version_id: str
    #: Seconds the state was being written: the actor's whole pause (the digest check comes after).
    pause_s: float
    changed_elements: int
    #: True/False once the state digest the manifest records has been checked; None while the check
    #: is pending (``digest_pending``) and when there is none to check.
    state_digest_ok: bool | None
    #: Seconds from the manifest becoming visible to the version being staged.
    stage_s: float
    #: Wall-clock time (``time.time()``, comparable with a manifest's ``created_at``) at which the
    #: version was staged, ready to commit.
    staged_at: float
    #: Whether this commit replaced the whole state (keyframe catch-up) instead of a delta.
    full: bool = False
    #: Whether the state digest is being checked in the background (see :meth:`Subscriber.confirm`).
    digest_pending: bool = False
    #: Seconds the digest check took, off the pause (None: none has finished).
    digest_s: float | None = None


class FullUpdate:
    """A catch-up: replace every tensor's contents (keyframe + deltas), undoable, in two copies.

    Commit *swaps* the contents of the live tensors and the new ones (chunk by chunk, through a
    small buffer), so afterwards the new tensors hold the old values for a rollback: the live
    state and the new state, never a third clone.
    """

    SWAP_CHUNK = 4 << 20  # elements per swap step

    def __init__(self, state: MutableMapping[str, Any], new: dict[str, Any]) -> None:
        self._state = state
        self._new = new
        self._swapped = False
        self._adopted = False
        self.changed_elements = sum(int(t.numel()) for t in new.values())

    def _swap(self) -> None:
        import torch

        with torch.no_grad():  # an engine's parameters (views of them) may require grad
            for name, t in self._new.items():  # same dtype and shape: copy_ is then bit-exact
                live, new = self._state[name].view(-1), t.view(-1)
                for a in range(0, live.numel(), self.SWAP_CHUNK):
                    tmp = live[a : a + self.SWAP_CHUNK].clone()
                    live[a : a + self.SWAP_CHUNK].copy_(new[a : a + self.SWAP_CHUNK])
                    new[a : a + self.SWAP_CHUNK].copy_(tmp)

    def commit(self) -> None:
        if not self._state:
            self._state.update(self._new)
            self._adopted = True
            return
        if sorted(self._state) != sorted(self._new):
            raise StagingError("catch-up state has other tensors than the live state")
        for name, t in self._new.items():
            live = self._state[name]
            if live.dtype != t.dtype or live.shape != t.shape:
                raise StagingError(f"catch-up tensor {name!r} is {t.dtype}{list(t.shape)}, live {live.dtype}{list(live.shape)}")
            if not live.is_contiguous() or not t.is_contiguous():
                raise StagingError(f"catch-up tensor {name!r} is not contiguous")
        self._swap()
        self._swapped = True

    def rollback(self) -> None:
        if self._adopted:
            for name in self._new:
                self._state.pop(name, None)
            return
        if self._swapped:
            self._swap()
            self._swapped = False


class InPlace:
    """A first bootstrap that loaded straight into the live tensors: nothing left to write, and
    nothing to roll back to (no version was held, the tensors held no run's weights)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.changed_elements = sum(int(t.numel()) for t in state.values())

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass


@dataclass
class Staged:
    version: int
    version_id: str
    manifest: Manifest
    update: Any  # StagedUpdate, FullUpdate or InPlace
    stage_s: float
    full: bool
    staged_at: float = field(default_factory=time.time)
    #: a full update (catch-up) whose state digest was checked as it was built
    digest_checked: bool = False


@dataclass
class DigestCheck:
    """A committed version whose state digest is being computed in a background thread."""

    staged: Staged
    previous: tuple[int | None, str | None]  # what the subscriber held before the commit
    info: CommitInfo
    future: Future[tuple[str, float]]  # (digest, seconds)

    def matches(self) -> bool:
        """Whether the digest equals the manifest's (waits for it; False if computing it failed)."""
        recorded = self.staged.manifest.state_digest
        return self.future.exception() is None and recorded is not None and self.future.result()[0] == recorded.value


def timed_digest(state: Mapping[str, Any], algo: str) -> tuple[str, float]:
    from deltarl.codec.tensors import state_digest

    t0 = time.monotonic()
    return state_digest(state, algo), time.monotonic() - t0


def loadable_in_place(state: MutableMapping[str, Any], table: Sequence[TensorSpec]) -> dict[str, Any] | None:
    """``state`` itself, if a keyframe can load straight into it: it has exactly the run's tensors,
    as contiguous CPU tensors of their dtypes and shapes (an actor's model, built before it joins).
    Then a bootstrap holds one copy of the model, not two. Else None."""
    import torch

    if set(state) != {t.name for t in table}:
        return None
    for spec in table:
        t = state[spec.name]
        if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
                and str(t.dtype) == f"torch.{spec.dtype}" and tuple(t.shape) == tuple(spec.shape)):
            return None
    return state if isinstance(state, dict) else dict(state)
