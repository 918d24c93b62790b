"""deltarl.protocol: the coordinator's wire records and its HTTP client.

Both the actor and the trainer speak to the coordinator; the records they exchange and the client
they use live here, below all three roles, so no role imports another.

* :mod:`~deltarl.protocol.records` - versioned wire/stored records (StepSpec, PromptItem, LeaseRecord,
  RolloutResult, Sample, AdmittedRecord, StepManifest, Ack, request/response bodies)
* :mod:`~deltarl.protocol.client` - ``CoordinatorClient`` (async) and ``SyncCoordinatorClient``

The records and clients are imported from their modules by the roles that speak them: nothing is exported here.
"""

__all__: list[str] = []
