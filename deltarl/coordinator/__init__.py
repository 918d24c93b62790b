"""deltarl.coordinator: who generates which prompts, and which results enter training.

* :mod:`~deltarl.coordinator.config` - ``SchedulerConfig``, ``ServiceConfig``, ``CoordinatorConfig`` (YAML/JSON)
* :mod:`~deltarl.coordinator.scheduler` - the pure state machine (EMA tokens/s, proportional guided
  leases, deadlines, death by silence, version-gated two-phase admission); :mod:`~deltarl.coordinator.state`
  holds its types, :mod:`~deltarl.coordinator.views` its read-only views and invariant check
* :mod:`~deltarl.coordinator.persistence` - write-once records under ``<run>/rollouts/`` and
  ``<run>/coordinator/``; ``recover``
* :mod:`~deltarl.coordinator.server` - the aiohttp app (bearer tokens, long-poll results, /status, /metrics)
* :mod:`~deltarl.coordinator.audit` - checks of stored rollouts against the version chain and their leases

The wire records and the client are :mod:`deltarl.protocol`; the simulated fleet is :mod:`deltarl.testing.fleet`.
"""
from __future__ import annotations

from deltarl.lazy import lazy_exports

#: Public name -> the module that defines it (imported on first use: ``import deltarl.coordinator`` stays light).
_EXPORTS = {
    "AuditReport": "deltarl.coordinator.audit",
    "Coordinator": "deltarl.coordinator.server",
    "CoordinatorConfig": "deltarl.coordinator.config",
    "CoordinatorStore": "deltarl.coordinator.persistence",
    "Scheduler": "deltarl.coordinator.scheduler",
    "SchedulerConfig": "deltarl.coordinator.config",
    "ServiceConfig": "deltarl.coordinator.config",
    "audit_run": "deltarl.coordinator.audit",
    "check_invariants": "deltarl.coordinator.views",
    "create_app": "deltarl.coordinator.server",
    "fleet_status": "deltarl.coordinator.views",
    "recover": "deltarl.coordinator.persistence",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
