"""The driver's side of the ``deltarl`` backend: start, update and query a vLLM engine in a few calls.

These wrap vLLM's own weight-transfer calls (``collective_rpc`` of ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``, exactly what ``AsyncLLM``
and ``vllm serve``'s RLHF routes send); any client speaking that protocol drives the engine the
same way. Nothing here imports vLLM.
"""

from __future__ import annotations

from typing import Any

from deltarl.actor.backends.vllm import (
    ENGINE_KWARGS as ENGINE_KWARGS,  # defined once, with the actor's backend
)
from deltarl.actor.backends.vllm import engine_attach, engine_finish, engine_status, engine_update


def attach(llm: Any, store: str, run: str, **init: Any) -> dict[str, Any]:
    """Point the engine at a run and load its version (default: HEAD) into the served weights.

    Args:
        llm: a ``vllm.LLM`` started with :data:`ENGINE_KWARGS`.
        store: the origin store URL (a path, ``s3://…``, a relay's ``http://…``).
        run: the run's name.
        **init: the other fields of :class:`~deltarl.integrations.vllm.engine.DeltaRLInitInfo`
            (``relays=``, ``version=``, ``streams=``, ``token=``, ``verify=``).

    Returns:
        The first worker's :func:`status`.

    Example:
        >>> llm = LLM(model="/ckpt", dtype="bfloat16", **ENGINE_KWARGS)  # doctest: +SKIP
        >>> attach(llm, "s3://runs", "qwen3-grpo", relays=["http://relay:8470"])  # doctest: +SKIP
        {'version': 12, 'version_id': '…', …}
    """
    return engine_attach(llm, store, run, **init)


def update(llm: Any, version: int | str = "latest", *, wait_s: float = 0.0) -> dict[str, Any]:
    """Stage ``version`` (the next after the served one, or ``"latest"``) in every worker, then
    commit it in place; the prefix cache is reset after. A refused version raises (vLLM's error,
    carrying deltarl's message) and the served weights are unchanged.

    Returns:
        The first worker's :func:`status` (the version served and the update's timings).
    """
    return engine_update(llm, version, wait_s=wait_s)


def status(llm: Any, *, digest: bool = False) -> list[dict[str, Any]]:
    """Each worker's served version, version id and last update's timings (``digest``: the state
    digest of its served weights too, to compare with a manifest's)."""
    return engine_status(llm, digest=digest)


class LLMSyncClient:
    """vLLM's trainer-side ``VLLMWeightSyncClient`` protocol over an offline ``vllm.LLM`` in this
    process (vLLM ships HTTP and Ray clients; this is the in-process one)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})
        self.llm.reset_prefix_cache()

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        engine_finish(self.llm)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()
