"""deltarl.protocol: the coordinator's wire records and its HTTP client.

Both the actor and the trainer speak to the coordinator; the records they exchange and the client
they use live here, below all three roles, so no role imports another.

* :mod:`~deltarl.protocol.records` - versioned wire/stored records (StepSpec, PromptItem, LeaseRecord,
  RolloutResult, Sample, AdmittedRecord, StepManifest, Ack, request/response bodies)
* :mod:`~deltarl.protocol.client` - ``CoordinatorClient`` (async) and ``SyncCoordinatorClient``
"""
from __future__ import annotations

from deltarl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__)  # its names: deltarl.lazy.SURFACE
