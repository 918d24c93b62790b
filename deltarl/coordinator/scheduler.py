"""The coordinator's scheduling state machine: pure (no I/O), driven by an injectable clock.

It tracks actors (registration, heartbeats, death by silence, rejoin), an EMA of each actor's
measured tokens/s, the open steps' prompt pools, and leases with deadlines. Every prompt of a step
is always in exactly one of three places: the pool, one active lease, or admitted.

Assignment: an actor asking for work gets a slice of the remaining work sized so that every live
actor finishes together: with total remaining work ``W`` (pool plus everyone's outstanding leases)
and speeds ``s_i``, actor ``i``'s target is ``s_i * W / sum(s) - outstanding_i``; a lease is
``1/chunks`` of that target (guided self-scheduling, so the tail is cut fine), capped by
``max_lease_seconds``. An unmeasured actor gets a small probe lease and the prior speed (the median
of measured actors, else ``prior_tokens_per_second``); its first result replaces the prior.

Admission is two-phase so results are durable before they are acknowledged:
:meth:`Scheduler.begin_admission` validates (lease, actor, step, version, prompts) and pins the lease;
the caller writes the record to the store, then calls :meth:`Scheduler.complete_admission` (or
:meth:`Scheduler.abort_admission` if the write failed). A pinned lease does not expire.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from deltarl.coordinator.config import SchedulerConfig
from deltarl.coordinator.state import (
    ActorState,
    Decision,
    LeaseState,
    LeaseStatus,
    Pool,
    Reason,
    Step,
    proportional_split,
)
from deltarl.errors import CoordinatorError, UnknownActor
from deltarl.protocol.records import (
    ActorRecord,
    AdmittedRecord,
    LeaseRecord,
    PromptItem,
    RolloutResult,
    StepSpec,
)

__all__ = ["Decision", "LeaseStatus", "Reason", "Scheduler", "proportional_split"]

log = logging.getLogger(__name__)


class Scheduler:
    """The coordinator's state. Not thread-safe: call it from one thread (the event loop)."""

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[str], str] | None = None,
    ) -> None:
        self.config = config or SchedulerConfig()
        self._clock = clock
        if new_id is None:  # unique across restarts (a fresh random prefix), cheap per id
            epoch, counter = uuid.uuid4().hex[:12], itertools.count()
            new_id = lambda prefix: f"{prefix}-{epoch}-{next(counter):x}"  # noqa: E731
        self._new_id = new_id
        self.actors: dict[str, ActorState] = {}
        self.leases: dict[str, LeaseState] = {}
        self.steps: dict[int, Step] = {}
        self._active: set[str] = set()  # ACTIVE or COMMITTING lease ids
        self.tokens_per_sample = self.config.prior_tokens_per_sample
        self._tps_measured = False
        self.rejections: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()

    def now(self) -> float:
        return self._clock()

    # --- actors -----------------------------------------------------------------------------------

    def new_actor(self, region: str = "", backend: str = "", capabilities: dict[str, Any] | None = None) -> ActorRecord:
        """A fresh actor record (not yet added: persist it, then :meth:`add_actor`)."""
        return ActorRecord(
            actor_id=self._new_id("actor"), region=region, backend=backend,
            capabilities=capabilities or {}, registered_at=self.now(),
        )

    def register(self, region: str = "", backend: str = "", capabilities: dict[str, Any] | None = None) -> ActorRecord:
        """Create and add a new actor (alive, unmeasured) and return its record."""
        record = self.new_actor(region, backend, capabilities)
        self.add_actor(record)
        return record

    def add_actor(self, record: ActorRecord) -> None:
        """Add a registered actor (also used by recovery, which counts it as just seen)."""
        if record.actor_id not in self.actors:
            self.actors[record.actor_id] = ActorState(record=record, last_seen=self.now())
            self.counters["actors_registered"] += 1

    def heartbeat(self, actor_id: str) -> None:
        """Mark the actor seen now; a dead actor that speaks again rejoins."""
        self._touch(self._actor(actor_id), self.now())

    def leave(self, actor_id: str) -> None:
        """The actor stopped cleanly: no longer alive, counted as left (not died); its active leases
        are revoked so their prompts go to others at once."""
        actor = self._actor(actor_id)
        if not actor.alive:
            return
        actor.alive, actor.left = False, True
        self.counters["actors_left"] += 1
        for lid in sorted(actor.leases):
            lease = self.leases[lid]
            if lease.status is LeaseStatus.ACTIVE:
                self._release(lease, LeaseStatus.REVOKED)
        log.info("actor %s left", actor_id)

    def _actor(self, actor_id: str) -> ActorState:
        try:
            return self.actors[actor_id]
        except KeyError:
            raise UnknownActor(f"unknown actor {actor_id!r}") from None

    def _touch(self, actor: ActorState, now: float) -> None:
        actor.last_seen = max(actor.last_seen, now)
        if not actor.alive:
            actor.alive, actor.left = True, False
            self.counters["actors_rejoined"] += 1
            log.info("actor %s rejoined", actor.record.actor_id)

    def rate_of(self, actor_id: str) -> float:
        """The actor's EMA tokens/s, or the prior if it has not been measured yet."""
        actor = self._actor(actor_id)
        return actor.rate if actor.measured else self._prior_rate()

    def _prior_rate(self) -> float:
        measured = [a.rate for a in self.actors.values() if a.alive and a.measured]
        return statistics.median(measured) if measured else self.config.prior_tokens_per_second

    # --- steps ------------------------------------------------------------------------------------

    def open_step(self, spec: StepSpec) -> bool:
        """Open a step; returns False if the same spec was already open (an idempotent retry)."""
        existing = self.steps.get(spec.step)
        if existing is not None:
            if existing.spec.same_request(spec):
                return False
            raise CoordinatorError(f"step {spec.step} is already open with other prompts or versions")
        self.check_spec(spec)
        group = {p.prompt_id: p.group_size for p in spec.prompts}
        items = {p.prompt_id: p for p in spec.prompts}
        self.steps[spec.step] = Step(spec=spec, group=group, pool=Pool(group), items=items)
        self.counters["steps_opened"] += 1
        return True

    def check_spec(self, spec: StepSpec) -> None:
        """Refuse a step that accepts more versions than the staleness bound allows."""
        if len(spec.accepted_versions) > self.config.max_staleness + 1:
            raise CoordinatorError(
                f"step {spec.step} accepts {len(spec.accepted_versions)} versions; "
                f"max_staleness={self.config.max_staleness} allows {self.config.max_staleness + 1}"
            )

    def close_step(self, step: int) -> None:
        """Mark a complete step closed (its manifest is written)."""
        st = self.steps[step]
        if not st.complete:
            raise CoordinatorError(f"step {step} is not complete")
        st.closed = True

    def prompts_of(self, lease: LeaseRecord) -> list[PromptItem]:
        """The prompt items of a lease, in lease order."""
        items = self.steps[lease.step].items
        return [items[pid] for pid in lease.prompt_ids]

    def forget_step(self, step: int) -> None:
        """Drop a closed step and its leases from memory (its records stay in the store)."""
        st = self.steps.get(step)
        if st is None or not st.closed:
            return
        for lid in st.lease_ids:
            self.leases.pop(lid, None)
            self._active.discard(lid)
        del self.steps[step]

    def open_steps(self) -> list[int]:
        return sorted(n for n, st in self.steps.items() if not st.closed)

    # --- leases -----------------------------------------------------------------------------------

    def _outstanding(self, actor: ActorState, now: float, rate: float) -> float:
        """Estimated tokens still to generate on the actor's active leases at speed ``rate``."""
        if not actor.leases:
            return 0.0
        recs = [self.leases[i].record for i in actor.leases]
        start = max(min(r.granted_at for r in recs), actor.last_admit_at)
        return max(0.0, sum(r.expected_tokens for r in recs) - rate * max(0.0, now - start))

    def _pool_tokens(self) -> float:
        return sum(st.pool.samples for st in self.steps.values() if not st.closed) * self.tokens_per_sample

    def _targets(self, now: float) -> dict[str, float]:
        """Each live actor's fair share of all remaining work, minus what it already holds (tokens)."""
        live = [a for a in self.actors.values() if a.alive]
        if not live:
            return {}
        prior = self._prior_rate()
        rates = {a.record.actor_id: a.rate if a.measured else prior for a in live}
        outstanding = {a.record.actor_id: self._outstanding(a, now, rates[a.record.actor_id]) for a in live}
        weights = dict.fromkeys(rates, 1.0) if self.config.policy == "equal" else rates
        total = self._pool_tokens() + sum(outstanding.values())
        wsum = sum(weights.values())
        if wsum <= 0.0:  # no speed known above zero: equal shares
            weights, wsum = dict.fromkeys(rates, 1.0), float(len(rates))
        return {aid: total * weights[aid] / wsum - outstanding[aid] for aid in outstanding}

    def shares(self) -> dict[str, int]:
        """Planned prompts of the remaining pool per live actor (for the fleet view and tests)."""
        targets = {k: max(v, 0.0) for k, v in self._targets(self.now()).items()}
        pool = sum(len(st.pool) for st in self.steps.values() if not st.closed)
        return proportional_split(pool, targets)

    def request_lease(self, actor_id: str, max_prompts: int | None = None) -> LeaseRecord | None:
        """Grant the actor its next slice of work, or ``None`` if there is none for it now."""
        now = self.now()
        actor = self._actor(actor_id)
        self._touch(actor, now)
        self.tick()
        step = next((self.steps[n] for n in self.open_steps() if self.steps[n].pool), None)
        if step is None:
            return None
        cfg = self.config
        rate = self.rate_of(actor_id)
        target = self._targets(now).get(actor_id, 0.0)
        if target <= 0.0 and actor.leases:
            return None  # it holds its fair share already
        budget = min(target / cfg.chunks, rate * cfg.max_lease_seconds)
        limit = max_prompts if max_prompts is not None else len(step.pool)
        if not actor.measured:  # a probe: a few prompts, whatever the budget, to measure it quickly
            limit = min(limit, cfg.probe_prompts)
            budget = float("inf")
        chosen: list[str] = []
        work = 0.0
        while step.pool and len(chosen) < limit:
            cost = step.group[step.pool.peek()] * self.tokens_per_sample
            if chosen and work + cost > budget:
                break
            chosen.append(step.pool.pop())
            work += cost
        if not chosen:
            return None
        expected = work / rate
        record = LeaseRecord(
            lease_id=self._new_id("lease"), step=step.spec.step, actor_id=actor_id, prompt_ids=chosen,
            granted_at=now, deadline=now + expected * cfg.lease_slack + cfg.lease_margin_s, expected_tokens=work,
        )
        self._add_lease(record)
        self.counters["leases_granted"] += 1
        return record

    def _add_lease(self, record: LeaseRecord) -> None:
        st = self.steps[record.step]
        for pid in record.prompt_ids:
            st.leased[pid] = record.lease_id
        st.lease_ids.append(record.lease_id)
        self.leases[record.lease_id] = LeaseState(record=record)
        self._active.add(record.lease_id)
        self._actor(record.actor_id).leases.add(record.lease_id)

    def cancel_lease(self, lease_id: str) -> None:
        """Withdraw a lease the actor never received (its record could not be persisted)."""
        lease = self.leases[lease_id]
        if lease.status is LeaseStatus.ACTIVE:
            self._release(lease, LeaseStatus.REVOKED)

    def _release(self, lease: LeaseState, status: LeaseStatus) -> None:
        """End an ACTIVE lease without admission: its prompts go back to the front of the pool."""
        lease.status = status
        rec = lease.record
        self._active.discard(rec.lease_id)
        self.actors[rec.actor_id].leases.discard(rec.lease_id)
        st = self.steps[rec.step]
        back = [pid for pid in rec.prompt_ids if st.leased.get(pid) == rec.lease_id]
        for pid in back:
            del st.leased[pid]
        st.pool.push_front(back)
        self.counters[f"leases_{status.value}"] += 1
        if status is LeaseStatus.EXPIRED and rec.expected_tokens > 0:  # it could not do the work in time: it is
            actor = self.actors[rec.actor_id]                          # at most this fast (a lease that expected no
                                                                       # tokens says nothing of its speed)
            bound = rec.expected_tokens / max(self.now() - rec.granted_at, 1e-6)
            if bound < self.rate_of(rec.actor_id):
                actor.rate, actor.measured = bound, True

    def _observe(self, actor: ActorState, tokens: int, seconds: float) -> None:
        """Fold one measured speed into the actor's EMA (the first one replaces the prior)."""
        if seconds <= 0 or tokens <= 0:
            return
        sample = tokens / seconds
        a = self.config.ema_alpha
        actor.rate = sample if not actor.measured else a * sample + (1 - a) * actor.rate
        actor.measured = True

    def tick(self) -> list[str]:
        """Declare silent actors dead (revoking their leases) and expire overdue leases.

        Returns a line per event, for logging.
        """
        now = self.now()
        events: list[str] = []
        for actor in self.actors.values():
            if actor.alive and now - actor.last_seen > self.config.heartbeat_timeout_s:
                actor.alive = False
                self.counters["actors_died"] += 1
                events.append(f"actor {actor.record.actor_id} dead (silent {now - actor.last_seen:.1f}s)")
                for lid in sorted(actor.leases):
                    lease = self.leases[lid]
                    if lease.status is LeaseStatus.ACTIVE:
                        self._release(lease, LeaseStatus.REVOKED)
                        events.append(f"lease {lid} revoked")
        for lid in sorted(self._active):
            lease = self.leases[lid]
            if lease.status is LeaseStatus.ACTIVE and now > lease.record.deadline:
                self._release(lease, LeaseStatus.EXPIRED)
                events.append(f"lease {lid} expired")
        for line in events:
            log.info("%s", line)
        return events

    # --- admission --------------------------------------------------------------------------------

    def _reject(self, reason: Reason, message: str) -> Decision:
        self.rejections[reason.value] += 1
        return Decision(kind="reject", reason=reason, message=message)

    def begin_admission(self, result: RolloutResult, digest: str) -> Decision:
        """Validate a result; on ``admit`` the lease is pinned until complete/abort_admission."""
        now = self.now()
        lease = self.leases.get(result.lease_id)
        if lease is None:
            return self._reject(Reason.UNKNOWN_LEASE, f"no lease {result.lease_id!r}")
        rec = lease.record
        if rec.actor_id != result.actor_id:
            return self._reject(Reason.WRONG_ACTOR, f"lease {rec.lease_id} is held by another actor")
        self._touch(self.actors[rec.actor_id], now)
        if rec.step != result.step:
            return self._reject(Reason.WRONG_STEP, f"lease {rec.lease_id} is for step {rec.step}, not {result.step}")
        if lease.status is LeaseStatus.ADMITTED:
            if lease.digest == digest:
                self.counters["duplicates"] += 1
                return Decision(kind="duplicate", lease=rec, key=lease.key)
            return self._reject(Reason.ALREADY_ADMITTED, f"lease {rec.lease_id} was admitted with other content")
        if lease.status is LeaseStatus.COMMITTING:
            return self._reject(Reason.IN_PROGRESS, f"lease {rec.lease_id} is being admitted")
        if lease.status is LeaseStatus.ACTIVE and now > rec.deadline:
            self._release(lease, LeaseStatus.EXPIRED)
        if lease.status is LeaseStatus.EXPIRED:
            if not lease.late_seen:  # rejected, but it tells how fast its actor really is
                lease.late_seen = True
                actor = self.actors[rec.actor_id]
                self._observe(actor, result.tokens, now - max(rec.granted_at, actor.last_admit_at))
            return self._reject(Reason.LEASE_EXPIRED, f"lease {rec.lease_id} expired at {rec.deadline:.3f}")
        if lease.status is LeaseStatus.REVOKED:
            return self._reject(Reason.LEASE_REVOKED, f"lease {rec.lease_id} was revoked (actor declared dead)")
        st = self.steps[rec.step]
        if result.version_id not in st.spec.accepted_versions:
            return self._reject(
                Reason.VERSION_NOT_ACCEPTED, f"step {rec.step} does not accept version {result.version_id!r}"
            )
        wanted = {pid: st.group[pid] for pid in rec.prompt_ids}
        if result.prompt_counts() != wanted:
            return self._reject(Reason.PROMPT_MISMATCH, "samples do not cover the leased prompts x group sizes")
        lease.status = LeaseStatus.COMMITTING
        return Decision(kind="admit", lease=rec, at=now)

    def abort_admission(self, lease_id: str) -> None:
        """The record could not be written: the lease is active again (and may now expire)."""
        lease = self.leases[lease_id]
        if lease.status is LeaseStatus.COMMITTING:
            lease.status = LeaseStatus.ACTIVE

    def complete_admission(self, record: AdmittedRecord, key: str) -> bool:
        """The record is durable: admit its prompts and measure the actor. Returns step complete."""
        lease = self.leases[record.lease.lease_id]
        if lease.status is not LeaseStatus.COMMITTING:
            raise CoordinatorError(f"lease {lease.record.lease_id} is {lease.status.value}, not committing")
        self._admit(lease, record, key)
        return self.steps[record.step].complete

    def _admit(self, lease: LeaseState, record: AdmittedRecord, key: str) -> None:
        rec = lease.record
        lease.status, lease.digest, lease.key = LeaseStatus.ADMITTED, record.result_sha256, key
        self._active.discard(rec.lease_id)
        st = self.steps[rec.step]
        for pid in rec.prompt_ids:
            st.leased.pop(pid, None)
            st.admitted[pid] = rec.lease_id
        actor = self.actors[rec.actor_id]
        actor.leases.discard(rec.lease_id)
        tokens, samples = record.result.tokens, len(record.result.samples)
        self._observe(actor, tokens, record.admitted_at - max(rec.granted_at, actor.last_admit_at))
        actor.last_admit_at = max(actor.last_admit_at, record.admitted_at)
        actor.admitted_prompts += len(rec.prompt_ids)
        actor.admitted_tokens += tokens
        if samples:
            per = tokens / samples
            if self._tps_measured:
                self.tokens_per_sample = 0.8 * self.tokens_per_sample + 0.2 * per
            else:
                self.tokens_per_sample, self._tps_measured = per, True
        self.counters["results_admitted"] += 1

    # --- recovery ---------------------------------------------------------------------------------

    def restore_lease(self, record: LeaseRecord) -> None:
        """Re-add a persisted lease (call in grant order). A later grant of the same prompts proves
        the earlier lease was revoked or expired; it is marked so."""
        if record.lease_id in self.leases or record.step not in self.steps:
            return
        if record.actor_id not in self.actors:
            self.add_actor(ActorRecord(actor_id=record.actor_id, registered_at=record.granted_at))
        st = self.steps[record.step]
        for pid in record.prompt_ids:
            prior = st.leased.get(pid)
            if prior is not None:
                self._release(self.leases[prior], LeaseStatus.REVOKED)
        for pid in record.prompt_ids:
            if pid in st.pool:
                st.pool.remove(pid)
        self._add_lease(record)

    def restore_admission(self, record: AdmittedRecord, key: str) -> None:
        """Re-apply an admitted record found in the store (call in admission order)."""
        if record.step not in self.steps:
            return
        lease = self.leases.get(record.lease.lease_id)
        if lease is None:
            self.restore_lease(record.lease)
            lease = self.leases[record.lease.lease_id]
        if lease.status is LeaseStatus.ADMITTED:
            return
        if lease.status is not LeaseStatus.ACTIVE:  # released after restore: take its prompts back
            st = self.steps[record.step]
            for pid in lease.record.prompt_ids:
                holder = st.leased.get(pid)
                if holder is not None and holder != lease.record.lease_id:
                    self._release(self.leases[holder], LeaseStatus.REVOKED)
                if pid in st.pool:
                    st.pool.remove(pid)
        self._admit(lease, record, key)
