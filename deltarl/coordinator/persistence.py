"""The coordinator's records in the run's store, and recovery of its state from them.

Layout (every object write-once, ``put_if_absent``)::

    <run>/rollouts/step-000000000042/spec.json                  the step as the trainer opened it
    <run>/rollouts/step-000000000042/results/<lease_id>.json    one AdmittedRecord per admitted lease
    <run>/rollouts/step-000000000042/manifest.json              StepManifest, once the step is complete
    <run>/coordinator/actors/<actor_id>.json                    ActorRecord, before the id is returned
    <run>/coordinator/leases/step-000000000042/<lease_id>.json  LeaseRecord, before the actor sees it

An admitted result is acknowledged only after its record is durable, so :func:`recover` (which
replays these records into a fresh :class:`~deltarl.coordinator.scheduler.Scheduler`) loses no
admitted result; leases granted before a crash stay valid until their deadlines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from deltarl.coordinator.config import SchedulerConfig
from deltarl.coordinator.scheduler import Scheduler
from deltarl.coordinator.views import check_invariants
from deltarl.errors import ObjectExists, ObjectNotFound, RecordConflict
from deltarl.pipeline.layout import VERSION_DIGITS, RunLayout
from deltarl.protocol.records import (
    ActorRecord,
    AdmittedRecord,
    LeaseRecord,
    Record,
    StepManifest,
    StepSpec,
    decode,
    encode,
    sha256_of,
)
from deltarl.storage.store import ObjectStore

log = logging.getLogger(__name__)



class CoordinatorStore:
    """Key builders, write-once writes and reads of one run's coordinator records. Blocking I/O."""

    def __init__(self, store: ObjectStore, run: str) -> None:
        self.store = store
        self.layout = RunLayout(run)
        self.run = self.layout.run

    # --- keys -------------------------------------------------------------------------------------

    @property
    def rollouts_root(self) -> str:
        return f"{self.run}/rollouts/"

    def spec_key(self, step: int) -> str:
        return self.layout.rollouts_prefix(step) + "spec.json"

    def manifest_key(self, step: int) -> str:
        return self.layout.rollouts_prefix(step) + "manifest.json"

    def results_prefix(self, step: int) -> str:
        return self.layout.rollouts_prefix(step) + "results/"

    def result_key(self, step: int, lease_id: str) -> str:
        return self.results_prefix(step) + f"{lease_id}.json"

    @property
    def actors_prefix(self) -> str:
        return self.layout.coordinator_prefix + "actors/"

    def actor_key(self, actor_id: str) -> str:
        return self.actors_prefix + f"{actor_id}.json"

    def leases_prefix(self, step: int) -> str:
        return self.layout.coordinator_prefix + f"leases/step-{step:0{VERSION_DIGITS}d}/"

    def lease_key(self, step: int, lease_id: str) -> str:
        return self.leases_prefix(step) + f"{lease_id}.json"

    # --- writes -----------------------------------------------------------------------------------

    def _write_once(self, key: str, record: Record, same: Callable[[bytes], bool]) -> bool:
        """Create ``key``; if it exists, accept it when ``same(existing)``. Returns True if written."""
        try:
            self.store.put_if_absent(key, encode(record))
            return True
        except ObjectExists:
            if same(self.store.get(key)):
                return False
            raise RecordConflict(f"{key} already holds a different record") from None

    def put_spec(self, spec: StepSpec) -> StepSpec:
        """Persist a step spec; a retry of the same request returns the stored spec."""
        key = self.spec_key(spec.step)
        if self._write_once(key, spec, lambda old: decode(StepSpec, old).same_request(spec)):
            return spec
        return decode(StepSpec, self.store.get(key))

    def put_actor(self, record: ActorRecord) -> None:
        self._write_once(self.actor_key(record.actor_id), record, lambda old: decode(ActorRecord, old) == record)

    def put_lease(self, record: LeaseRecord) -> None:
        key = self.lease_key(record.step, record.lease_id)
        self._write_once(key, record, lambda old: decode(LeaseRecord, old) == record)

    def put_admitted(self, record: AdmittedRecord) -> str:
        """Persist an admitted result; an identical result already there (a retry) is fine."""
        key = self.result_key(record.step, record.lease.lease_id)
        self._write_once(key, record, lambda old: decode(AdmittedRecord, old).result_sha256 == record.result_sha256)
        return key

    def put_manifest(self, manifest: StepManifest) -> StepManifest:
        """Persist a step's manifest; one already there listing the same results (a close retried
        after a restart) stands, and is returned: the stored manifest."""
        stored = manifest

        def same(old: bytes) -> bool:
            nonlocal stored
            stored = decode(StepManifest, old)
            return stored.result_keys == manifest.result_keys

        self._write_once(self.manifest_key(manifest.step), manifest, same)
        return stored

    # --- reads ------------------------------------------------------------------------------------

    def steps(self, *, with_spec: bool = True) -> list[int]:
        """Every step with a spec in the store (or, ``with_spec=False``, with any object), ascending."""
        out = set()
        for key in self.store.list(self.rollouts_root):
            rest = key[len(self.rollouts_root):]
            name, _, tail = rest.partition("/")
            if (tail == "spec.json" or not with_spec) and name.startswith("step-") and name[5:].isdigit():
                out.add(int(name[5:]))
        return sorted(out)

    def spec(self, step: int) -> StepSpec:
        return decode(StepSpec, self.store.get(self.spec_key(step)))

    def manifest(self, step: int) -> StepManifest | None:
        try:
            return decode(StepManifest, self.store.get(self.manifest_key(step)))
        except ObjectNotFound:
            return None

    def admitted(self, key: str) -> AdmittedRecord:
        return decode(AdmittedRecord, self.store.get(key))

    def results(self, step: int) -> list[tuple[str, AdmittedRecord]]:
        """Every admitted record of the step, in admission order."""
        out = [(k, self.admitted(k)) for k in self.store.list(self.results_prefix(step))]
        out.sort(key=lambda kr: (kr[1].admitted_at, kr[0]))
        return out

    def actors(self) -> list[ActorRecord]:
        recs = [decode(ActorRecord, self.store.get(k)) for k in self.store.list(self.actors_prefix)]
        return sorted(recs, key=lambda r: (r.registered_at, r.actor_id))

    def leases(self, step: int) -> list[LeaseRecord]:
        recs = [decode(LeaseRecord, self.store.get(k)) for k in self.store.list(self.leases_prefix(step))]
        return sorted(recs, key=lambda r: (r.granted_at, r.lease_id))

    def lease(self, step: int, lease_id: str) -> LeaseRecord | None:
        try:
            return decode(LeaseRecord, self.store.get(self.lease_key(step, lease_id)))
        except ObjectNotFound:
            return None


def build_manifest(spec: StepSpec, results: Iterable[tuple[str, AdmittedRecord]], closed_at: float) -> StepManifest:
    """The closing record of a complete step."""
    items = sorted(results, key=lambda kr: kr[0])
    return StepManifest(
        step=spec.step,
        spec_sha256=sha256_of(spec),
        result_keys=[k for k, _ in items],
        lease_ids=[r.lease.lease_id for _, r in items],
        prompts=sum(len(r.lease.prompt_ids) for _, r in items),
        samples=sum(len(r.result.samples) for _, r in items),
        tokens=sum(r.result.tokens for _, r in items),
        opened_at=spec.opened_at,
        closed_at=closed_at,
    )


@dataclass
class Recovered:
    """What :func:`recover` rebuilt: the scheduler, and the open steps' admitted records."""

    scheduler: Scheduler
    results: dict[int, dict[str, tuple[str, AdmittedRecord]]] = field(default_factory=dict)
    specs: dict[int, StepSpec] = field(default_factory=dict)
    to_close: list[int] = field(default_factory=list)


def recover(
    store: ObjectStore,
    run: str,
    config: SchedulerConfig | None = None,
    clock: Callable[[], float] = time.time,
    new_id: Callable[[str], str] | None = None,
) -> Recovered:
    """Rebuild the coordinator's state from the store: actors, open steps, their leases and results.

    Steps that have a manifest are closed and are not loaded. Complete steps without a manifest
    (a crash between the last admission and the manifest) are listed in ``to_close``. ``new_id``
    makes the rebuilt scheduler's new ids (see :class:`Scheduler`); tests pass a deterministic one.
    """
    cstore = CoordinatorStore(store, run)
    sched = Scheduler(config, clock=clock, new_id=new_id)
    out = Recovered(scheduler=sched)
    for actor in cstore.actors():
        sched.add_actor(actor)
    for step in cstore.steps():
        if cstore.manifest(step) is not None:
            continue
        spec = cstore.spec(step)
        sched.open_step(spec)
        out.specs[step] = spec
        for lease in cstore.leases(step):
            sched.restore_lease(lease)
        results = cstore.results(step)
        for key, record in results:
            sched.restore_admission(record, key)
        out.results[step] = {r.lease.lease_id: (key, r) for key, r in results}
        if sched.steps[step].complete:
            out.to_close.append(step)
    check_invariants(sched)
    log.info(
        "recovered run %s: %d actors, %d open steps, %d admitted results",
        run, len(sched.actors), len(out.specs), sum(len(r) for r in out.results.values()),
    )
    return out
