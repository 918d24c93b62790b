"""The rollout coordinator: who generates which prompts, and which results enter training.

Modules (imports stay light: nothing here pulls aiohttp or torch until used):

* ``records``     versioned wire/stored records (StepSpec, PromptItem, LeaseRecord, RolloutResult,
                  Sample, AdmittedRecord, StepManifest, Ack, request/response bodies)
* ``config``      SchedulerConfig, ServiceConfig, CoordinatorConfig (YAML/JSON)
* ``scheduler``   the pure state machine (EMA tokens/s, proportional guided leases, deadlines,
                  death by silence, version-gated two-phase admission); ``state`` and ``views`` hold
                  its types and read-only views
* ``persistence`` write-once records under ``<run>/rollouts/`` and ``<run>/coordinator/``, ``recover``
* ``service``     the aiohttp app (bearer tokens, long-poll results, /status, /metrics)
* ``client``      CoordinatorClient (async) and SyncCoordinatorClient
* ``audit``       checks of stored rollouts against the version chain and their leases
* ``simulate``    a simulated fleet in virtual time (benchmarks and tests)
"""
