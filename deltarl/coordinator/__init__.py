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

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "config": ("CoordinatorConfig",),
    "server": ("Coordinator",),
    "scheduler": ("Scheduler",),
})
