"""``deltarl audit``: check every stored rollout of a run against the version chain and its lease.

For each admitted record under ``<run>/rollouts/step-<n>/results/`` it checks that

* its version id is in the run's verified version chain (``RunReader.kept_chain``: parent links
  hashed, from the oldest stored keyframe, since ``gc --keep-last`` removes older versions);
* the step accepted that version (the step's stored spec);
* its lease was valid when admitted: the lease was recorded under ``<run>/coordinator/leases/``,
  is held by the reporting (registered) actor, names the same step and prompts, and
  ``granted_at <= admitted_at <= deadline``;
* the record is self-consistent (result sha256, ``<lease_id>.json`` key, prompts x group sizes);
* no prompt of a step is admitted twice, and a closed step's manifest lists exactly its records
  and covers every prompt.

Content checks (``--rescore``) are done by the trainer's
``deltarl.trainer.rescore.rescore_rollouts``, which replays the claimed version's weights and
recomputes the sampled tokens' logprobs.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from deltarl.coordinator.persistence import CoordinatorStore
from deltarl.errors import DeltaRLError
from deltarl.pipeline.reader import RunReader
from deltarl.protocol.records import AdmittedRecord, LeaseRecord, StepSpec, sha256_of
from deltarl.storage.store import ObjectStore

log = logging.getLogger(__name__)


@dataclass
class Failure:
    """One failed check: where, which check, and what was found."""

    step: int | None
    key: str
    check: str
    detail: str


@dataclass
class StepAudit:
    step: int
    state: str  # "closed", "open" or "missing-spec"
    results: int = 0
    prompts: int = 0
    samples: int = 0
    tokens: int = 0
    versions: Counter[str] = field(default_factory=Counter)
    failures: int = 0


@dataclass
class AuditReport:
    run: str
    versions_in_chain: int
    steps: list[StepAudit] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    records: list[AdmittedRecord] = field(default_factory=list)
    chain: dict[str, int] = field(default_factory=dict)
    steps_in_store: int = 0

    def version_label(self, version_id: str) -> str:
        """``v<n>`` for a version in the chain, else ``?<id prefix>``."""
        n = self.chain.get(version_id)
        return f"v{n}" if n is not None else f"?{version_id[:8]}"

    @property
    def ok(self) -> bool:
        return not self.failures

    def counts(self) -> Counter[str]:
        return Counter(f.check for f in self.failures)


def version_chain(store: ObjectStore, run: str) -> dict[str, int]:
    """Version id -> version number for every version replay can rebuild, links verified: from the
    oldest stored keyframe (version 0 unless ``deltarl gc --keep-last`` removed older versions) up
    to the last committed version (HEAD, or past it while manifests exist: HEAD is only a hint)."""
    return RunReader(store, run).version_numbers()


class _Auditor:
    def __init__(self, store: ObjectStore, run: str, chain: dict[str, int]) -> None:
        self.cs = CoordinatorStore(store, run)
        self.chain = chain
        self.report = AuditReport(run=run, versions_in_chain=len(chain), chain=chain)
        prefix = self.cs.actors_prefix
        self.actors = {k[len(prefix) : -len(".json")] for k in store.list(prefix)}

    def fail(self, st: StepAudit | None, key: str, check: str, detail: str) -> None:
        self.report.failures.append(Failure(None if st is None else st.step, key, check, detail))
        if st is not None:
            st.failures += 1

    def step(self, n: int) -> None:
        cs = self.cs
        st = StepAudit(step=n, state="open")
        self.report.steps.append(st)
        spec: StepSpec | None = None
        try:
            spec = cs.spec(n)
        except DeltaRLError as err:
            st.state = "missing-spec"
            self.fail(st, cs.spec_key(n), "spec", str(err))
        manifest = None
        try:
            manifest = cs.manifest(n)
        except DeltaRLError as err:
            self.fail(st, cs.manifest_key(n), "manifest", str(err))
        if manifest is not None and spec is not None:
            st.state = "closed"
        group = {p.prompt_id: p.group_size for p in spec.prompts} if spec is not None else {}
        seen: dict[str, str] = {}
        keys: list[str] = []
        for key in cs.store.list(cs.results_prefix(n)):
            keys.append(key)
            try:
                rec = cs.admitted(key)
            except DeltaRLError as err:
                self.fail(st, key, "record", str(err))
                continue
            self.record(st, key, rec, spec, group, seen)
        if manifest is not None and spec is not None:
            if sorted(keys) != manifest.result_keys:
                self.fail(st, cs.manifest_key(n), "manifest", "manifest does not list exactly the stored results")
            if manifest.spec_sha256 != sha256_of(spec):
                self.fail(st, cs.manifest_key(n), "manifest", "manifest names another spec")
            if set(seen) != set(group):
                self.fail(st, cs.manifest_key(n), "coverage", f"{len(set(group) - set(seen))} prompts without a result")

    def record(self, st: StepAudit, key: str, rec: AdmittedRecord, spec: StepSpec | None,
               group: dict[str, int], seen: dict[str, str]) -> None:
        res, lease = rec.result, rec.lease
        st.results += 1
        st.prompts += len(lease.prompt_ids)
        st.samples += len(res.samples)
        st.tokens += res.tokens
        st.versions[res.version_id] += 1
        self.report.records.append(rec)
        if res.version_id not in self.chain:
            self.fail(st, key, "version_in_chain", f"version id {res.version_id[:16]}… is not in the run's chain")
        if spec is not None and res.version_id not in spec.accepted_versions:
            self.fail(st, key, "version_accepted", f"step {st.step} did not accept version {res.version_id[:16]}…")
        if not (rec.step == res.step == lease.step == st.step):
            self.fail(st, key, "step", f"record/result/lease steps {rec.step}/{res.step}/{lease.step}")
        if key.rsplit("/", 1)[-1] != f"{lease.lease_id}.json" or res.lease_id != lease.lease_id:
            self.fail(st, key, "lease_id", "key, result and lease name different leases")
        if res.actor_id != lease.actor_id:
            self.fail(st, key, "lease_holder", f"result from {res.actor_id}, lease held by {lease.actor_id}")
        if lease.actor_id not in self.actors:
            self.fail(st, key, "actor_registered", f"actor {lease.actor_id} never registered")
        if not lease.granted_at <= rec.admitted_at <= lease.deadline:
            self.fail(st, key, "lease_valid", f"admitted at {rec.admitted_at:.3f} outside the lease "
                      f"[{lease.granted_at:.3f}, {lease.deadline:.3f}]")
        stored = self._lease(st, key, lease)
        if stored is not None and stored != lease:
            self.fail(st, key, "lease_recorded", "the record's lease differs from the lease granted")
        if sha256_of(res) != rec.result_sha256:
            self.fail(st, key, "result_sha256", "result bytes do not match the recorded sha256")
        if res.prompt_counts() != {pid: group.get(pid, -1) for pid in lease.prompt_ids}:
            self.fail(st, key, "prompts", "samples do not match the leased prompts x group sizes")
        for pid in lease.prompt_ids:
            if pid in seen:
                self.fail(st, key, "double_admission", f"prompt {pid} also admitted in {seen[pid]}")
            seen[pid] = key

    def _lease(self, st: StepAudit, key: str, lease: LeaseRecord) -> LeaseRecord | None:
        try:
            stored = self.cs.lease(lease.step, lease.lease_id)
        except DeltaRLError as err:
            self.fail(st, key, "lease_recorded", str(err))
            return None
        if stored is None:
            self.fail(st, key, "lease_recorded", f"no lease record {self.cs.lease_key(lease.step, lease.lease_id)}")
        return stored


def audit_run(store: ObjectStore, run: str, steps: tuple[int | None, int | None] = (None, None)) -> AuditReport:
    """Audit every stored step in ``[steps[0], steps[1])`` (None: unbounded)."""
    try:
        chain = version_chain(store, run)
        chain_error = None
    except DeltaRLError as err:
        chain, chain_error = {}, err
    auditor = _Auditor(store, run, chain)
    if chain_error is not None:
        auditor.fail(None, f"{run}/versions/", "chain", f"version chain unreadable: {chain_error}")
    lo, hi = steps
    stored = auditor.cs.steps(with_spec=False)
    auditor.report.steps_in_store = len(stored)
    for n in stored:
        if (lo is None or n >= lo) and (hi is None or n < hi):
            auditor.step(n)
    return auditor.report
