"""The vLLM backend (``deltarl[vllm]``): generation with vLLM, weights updated by the ``deltarl``
weight-transfer engine inside vLLM's workers.

The engine (``deltarl.integrations.vllm``, registered with vLLM by deltarl's plugin) reads the
run in each worker, decodes against the live parameters and commits in place; this process only
sends vLLM's weight-transfer calls (a few dozen bytes each) and reads back the served version.
The actor names the engine by vLLM's protocol (backend ``deltarl``, the worker extension's class
path): it imports nothing of the integration, which re-exports :data:`ENGINE_KWARGS` from here. The
served weights never exist in this process, so the backend is an
:class:`~deltarl.actor.backends.base.EngineBackend` (no host-side state to commit into):
:class:`~deltarl.actor.engine_weights.EngineWeights` drives its updates through ``attach`` / ``update``. :func:`open_weights`
and :func:`build` are the actor's adapter (the table row is ``vllm``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from deltarl.actor.backends.base import FinishReason, Generation, ThroughputMeter
from deltarl.errors import RunError

if TYPE_CHECKING:
    from deltarl.actor.config import ActorConfig
    from deltarl.actor.engine_weights import EngineWeights
    from deltarl.actor.weights import Weights
    from deltarl.model.record import RunModelInfo
    from deltarl.storage.store import ObjectStore

#: how long a client waits between asking for a version the engine is still staging
ASK_AGAIN_S = 0.05
#: how long a client goes on asking for a published version the engine is staging
STAGE_TIMEOUT_S = 600.0
#: with a staging poll, the longest a client polls before it asks for the version again anyway (a
#: stage dropped for a newer HEAD never shows the version it asked for)
POLL_REASK_S = 2.0
_KIND = re.compile(r"\[deltarl:(\w+)\]")
_STAGING = re.compile(r"version (\d+) is being staged")

#: keyword arguments of ``vllm.LLM`` (or ``vllm serve`` flags) that select the deltarl engine; the
#: integration (``deltarl.integrations.vllm``) re-exports this dict and checks its names against its own
ENGINE_KWARGS: dict[str, Any] = {
    "weight_transfer_config": {"backend": "deltarl"},
    "worker_extension_cls": "deltarl.integrations.vllm.worker.DeltaRLWorkerExtension",
}


def engine_attach(llm: Any, store: str, run: str, **init: Any) -> dict[str, Any]:
    """vLLM's ``init_weight_transfer_engine`` for a run: the workers load its version (default HEAD);
    the prefix cache is reset after. The first worker's status."""
    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {"store": store, "run": run, **init}})
    llm.reset_prefix_cache()
    return engine_status(llm)[0]


def engine_finish(llm: Any) -> None:
    """vLLM's ``finish_weight_update``: the in-place commit; the prefix cache (KV computed under the
    old weights) is reset after, and a failed commit still closes vLLM's update session."""
    try:
        llm.collective_rpc("finish_weight_update")
    except BaseException:
        llm.collective_rpc("finish_weight_update")  # nothing staged now: closes vLLM's update session
        raise
    finally:
        llm.reset_prefix_cache()


def refusal_kind(err: BaseException) -> str | None:
    """The kind the deltarl engine tagged an error with (``[deltarl:NotStaged] …`` → ``"NotStaged"``),
    read from vLLM's wrapping of it (its RPC errors and ``vllm serve``'s HTTP 500 bodies carry the
    message), or None."""
    found = _KIND.search(str(err))
    return None if found is None else found.group(1)


def take_update(
    start: Callable[[], Any],
    update: Callable[[dict[str, Any]], Any],
    version: int | str = "latest",
    *,
    wait_s: float = 0.0,
    stage_timeout_s: float = STAGE_TIMEOUT_S,
    staged: Callable[[], Sequence[dict[str, Any]]] | None = None,
) -> None:
    """``start_weight_update`` + ``update_weights`` until the engine has the version staged: it
    answers ``NotStaged`` (staging in the background, generation going on) and ``NotPublished``
    (not committed yet: asked again for up to ``wait_s``) at once instead of holding vLLM's RPC,
    so a client asks again; any other refusal is raised. Call ``finish_weight_update`` after.

    ``staged``: each rank's :meth:`~deltarl.integrations.vllm.worker.DeltaRLWorkerExtension.deltarl_staged`
    (a call that never raises). With it, after a ``NotStaged`` the client polls that until every rank
    holds the version (or one reports an error) and asks once more, instead of a refused
    ``update_weights`` (an error vLLM logs with its traceback in every process) every
    :data:`ASK_AGAIN_S`."""
    t0 = time.monotonic()
    while True:
        start()
        left = wait_s - (time.monotonic() - t0)
        try:
            update({"version": version, "wait_s": max(0.0, left)})
            return
        except Exception as err:
            kind, waited = refusal_kind(err), time.monotonic() - t0
            if not ((kind == "NotStaged" and waited < stage_timeout_s) or (kind == "NotPublished" and left > 0)):
                raise
            target = _STAGING.search(str(err)) if kind == "NotStaged" else None
        if staged is None or target is None:
            time.sleep(ASK_AGAIN_S)
        else:
            wait_until_staged(staged, int(target.group(1)), min(POLL_REASK_S, max(0.0, t0 + stage_timeout_s - time.monotonic())))


def wait_until_staged(staged: Callable[[], Sequence[dict[str, Any]]], version: int, timeout_s: float) -> bool:
    """Poll ``staged`` (each rank's ``{"staged": N, "error": …}``) every :data:`ASK_AGAIN_S` until every
    rank has staged ``version`` or one reports an error (the next ask raises it); False if
    ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    while True:
        time.sleep(ASK_AGAIN_S)  # first: a rank's standing error must not turn the asking into a busy loop
        ranks = list(staged())
        if ranks and (any(r.get("error") for r in ranks) or all(r.get("staged") == version for r in ranks)):
            return True
        if time.monotonic() >= deadline:
            return False


def engine_update(llm: Any, version: int | str = "latest", *, wait_s: float = 0.0) -> dict[str, Any]:
    """Have every worker take ``version`` (staged in the background: fetched, verified, decoded),
    then commit it in place; a refused version raises and leaves the weights as they were. The
    first worker's status."""
    take_update(lambda: llm.collective_rpc("start_weight_update"),
                lambda info: llm.collective_rpc("update_weights", kwargs={"update_info": info}), version, wait_s=wait_s,
                staged=lambda: llm.collective_rpc("deltarl_staged"))
    engine_finish(llm)
    return engine_status(llm)[0]


def engine_status(llm: Any, *, digest: bool = False) -> list[dict[str, Any]]:
    """Each worker's served version, version id and last update's timings (``digest``: the state
    digest of its served weights too)."""
    return [dict(s) for s in llm.collective_rpc("deltarl_status", kwargs={"digest": digest})]


class VLLMEngineBackend:
    """A ``vllm.LLM`` serving a run through the ``deltarl`` weight-transfer engine."""

    def __init__(self, model_path: str, *, seed: int = 0, throttle: float = 1.0, **llm_kwargs: Any) -> None:
        """``model_path``: the run's local HF checkpoint (its config and tokenizer; the weights are
        replaced by the run's at :meth:`attach`). ``llm_kwargs`` go to ``vllm.LLM``."""
        if throttle < 1.0:
            raise ValueError("throttle must be >= 1 (1 = native speed)")
        from vllm import LLM  # deltarl's vLLM plugin asks for AMX state in each of its processes

        self.throttle = throttle
        opts = {"dtype": "bfloat16", "seed": seed, "logprobs_mode": "processed_logprobs", **llm_kwargs}
        self.llm = LLM(model=model_path, **ENGINE_KWARGS, **opts)
        self._meter = ThroughputMeter()

    # --- the engine ---------------------------------------------------------------------------------
    def attach(self, store: str, run: str, **init: Any) -> dict[str, Any]:
        """Load the run's ``version`` (default HEAD) into the workers; the first worker's status."""
        return engine_attach(self.llm, store, run, **init)

    def update(self, version: int | str = "latest", *, wait_s: float = 0.0) -> dict[str, Any]:
        """:func:`engine_update` on this engine."""
        return engine_update(self.llm, version, wait_s=wait_s)

    def status(self, *, digest: bool = False) -> dict[str, Any]:
        return engine_status(self.llm, digest=digest)[0]

    def served_digest(self) -> str:
        """The state digest of the weights the workers serve (hashed there, in place)."""
        return str(self.status(digest=True)["digest"])

    def close(self) -> None:
        """Shut vLLM's engine processes down."""
        self.llm.llm_engine.engine_core.shutdown()

    # --- GenerationBackend ----------------------------------------------------------------------------
    @property
    def tokens_per_second(self) -> float | None:
        return self._meter.value

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float, n: int = 1
    ) -> list[Generation]:
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, logprobs=0, detokenize=False)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        gens: list[Generation] = []
        for out in outs:
            for c in out.outputs:
                ids = [int(t) for t in c.token_ids]
                lps = [float(c.logprobs[i][t].logprob) for i, t in enumerate(ids)] if c.logprobs else []
                reason: FinishReason = "stop" if c.finish_reason == "stop" else "length"
                gens.append(Generation(ids, lps, reason))
        elapsed = time.perf_counter() - t0
        if self.throttle > 1.0:
            time.sleep(elapsed * (self.throttle - 1.0))
        self._meter.record(sum(len(g.completion_token_ids) for g in gens), time.perf_counter() - t0)
        return gens


# --- the actor's adapter (deltarl.actor.backends.table.BACKENDS["vllm"]) ------------------------------------
def open_weights(config: ActorConfig, store: ObjectStore | None) -> EngineWeights:
    """The engine-driving weights handle: this process reads only model.json, HEAD and manifests."""
    from deltarl.actor.engine_weights import EngineWeights

    return EngineWeights(config, store)


def build(config: ActorConfig, info: RunModelInfo, tokenizer: Any, weights: Weights) -> tuple[VLLMEngineBackend, Any]:
    """vLLM serving the run's checkpoint with ``config.engine_options``; ``weights`` drives its engine,
    whose workers load the run themselves (no state in this process: None)."""
    from deltarl.actor.engine_weights import EngineWeights

    if info.model.is_tiny:
        raise RunError("the vllm backend serves a local Hugging Face checkpoint: model.name must be its path")
    if not isinstance(weights, EngineWeights):
        raise TypeError("the vllm backend's weights come from deltarl.actor.backends.vllm.open_weights")
    backend = VLLMEngineBackend(info.model.name, seed=config.seed, throttle=config.throttle, **config.engine_options)
    weights.engine = backend
    return backend, None
