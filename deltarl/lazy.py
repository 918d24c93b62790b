"""The public surface of every lazily loaded package, on one page, and the hook that serves it.

``import deltarl`` (and ``deltarl --help``, and ``import deltarl.actor.fetcher``) must not pay for
torch, aiohttp or boto3, so a package's ``__init__`` imports nothing: it names its surface here,
in :data:`SURFACE`, and lets :func:`lazy_exports` import each name's module on first access::

    __getattr__, __dir__, __all__ = lazy_exports(__name__)

``tests/unit/test_public_api.py`` checks that every name another part of deltarl imports from a
package is in its surface, and that every name listed resolves.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

#: package -> "module:Name,Name module:Name ..." (modules relative to the package).
SURFACE: dict[str, str] = {
    "deltarl": "pipeline.publisher:Publisher pipeline.sharded:ShardedPublisher pipeline.publish_config:PublishConfig "
               "pipeline.writer:VersionInfo pipeline.replay:replay pipeline.reader:RunReader storage.open:open_store "
               "storage.store:ObjectStore integrations.trl:DeltaRLCallback errors:DeltaRLError",
    "deltarl.actor": "config:ActorConfig fetcher:FetchStats,Fetcher follower:Follower loop:ActorLoop "
                     "subscriber:Subscriber updates:CommitInfo weights:Weights metrics:WeightsMetrics source:FetcherSource "
                     "backends.vllm:engine_attach,engine_finish,engine_status,engine_update,take_update",
    "deltarl.coordinator": "audit:AuditReport,audit_run config:CoordinatorConfig,SchedulerConfig,ServiceConfig "
                           "persistence:CoordinatorStore,recover scheduler:Scheduler server:Coordinator,create_app "
                           "views:check_invariants,fleet_status",
    "deltarl.demo": "runner:DemoOptions,run_demo preset:check_checkpoint",
    "deltarl.integrations": "gather:gather_bf16 trl:DeltaRLCallback",
    "deltarl.model": "build:ModelSpec,build_model,export_bf16,load_bf16_into record:RunModelInfo,read_model_json,"
                     "write_model_json tasks:TaskSpec,build_task tokenizer:TokenizerSpec,load_tokenizer build:live_parameters record:model_json_key tasks:Task tokenizer:Tokenizer,encode_prompt hf_byte:save_hf_byte_tokenizer",
    "deltarl.protocol": "client:CoordinatorClient,SyncCoordinatorClient records:AdmittedRecord,LeaseRecord,PromptItem,"
                        "RolloutResult,Sample,StepSpec records:Ack,ActorRecord,HeartbeatRequest,LeaseGrant,LeaseRequest,LeaseResponse,MAX_STEP,Record,RegisterRequest,Registered,StepManifest,StepOpened,StepResults,decode,encode,sha256_of",
    "deltarl.testing": "faults:CrashAt fleet:Fleet,simulate ranks:leave_process_group,spawn_ranks "
                       "store_tests:StoreTests wan:EmulatedLink,LinkStats",
    "deltarl.updater": "inplace:InPlaceUpdater,Served,tag probe:Placement,derive_views ranks:Ranks shards:catch_up_regions,digest_shares,owners,stage_regions",
    "deltarl.trainer": "config:TrainerConfig grpo:GRPOConfig,GRPOTrainer,TrainStats loop:StepReport,TrainerLoop "
                       "rescore:rescore_rollouts config:SPARSE_GRPO,SPARSE_WARMUP loop:ClientCoordinator metrics:TrainerMetrics rescore:RescoreFinding sinks:SinkConfig,Sinks",
}


def surface(package: str) -> dict[str, str]:
    """``{name: defining module}`` of ``package``'s public surface."""
    out: dict[str, str] = {}
    for item in SURFACE[package].split():
        module, names = item.split(":")
        for name in names.split(","):
            out[name] = f"{package}.{module}"
    return out


def lazy_exports(package: str) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``: each name of its :data:`SURFACE` entry
    is imported from its module on first access; any other name is an AttributeError."""
    table = surface(package)

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__, sorted(table)
