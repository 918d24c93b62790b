"""``DeltaRLWorkerExtension``: read-back methods on vLLM's workers (``worker_extension_cls``).

vLLM's weight-transfer calls return nothing; these let the driver ask each worker what it serves
through ``llm.collective_rpc("deltarl_status")``: a small dict, never tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from deltarl.errors import ConfigError

WORKER_EXTENSION = f"{__name__}.DeltaRLWorkerExtension"


class DeltaRLWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.weight_transfer_engine``)."""

    weight_transfer_engine: Any

    def _deltarl_engine(self) -> Any:
        from deltarl.integrations.vllm.engine import DeltaRLEngine

        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, DeltaRLEngine):
            raise ConfigError("this vLLM engine was not started with weight_transfer_config={'backend': 'deltarl'}")
        return engine

    def deltarl_staged(self) -> dict[str, Any]:
        """What the background staging holds, cheaply and without raising: ``staged`` (the version
        ready to take, or None), ``error`` (its last error, ``[deltarl:Kind] …``, or None), ``rank``.
        A client polls this while a version stages instead of asking ``update_weights`` again."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "background"):
            return {"staged": None, "error": "[deltarl:ConfigError] no deltarl weight-transfer engine", "rank": None}
        return {**engine.background(), "rank": engine.updater.ranks.rank}

    def deltarl_status(self, digest: bool = False) -> dict[str, Any]:
        """The served version, its id and the last update's timings (no ``version`` key: nothing
        served), the version staged in the background and its last error (``[deltarl:Kind] …``),
        the worker's resident memory; with ``digest``, the state digest of this rank's served weights
        (``digest``, hashed in place) and of the whole engine's (``engine_digest``, joined from every rank);
        ``fetch``: what this worker has fetched (bytes by source, objects, retries); a rank staging its
        part (tensor/expert parallel): ``fetched_bytes`` and ``stage_parts`` (read + verify, decode wall
        and the staging thread's CPU seconds of the last staged version)."""
        engine = self._deltarl_engine()
        out: dict[str, Any] = {} if engine.served is None else dataclasses.asdict(engine.served)
        out["tensors"] = len(engine.views)
        out.update(engine.background())  # the version staged in the background, and its last error
        out["rss_bytes"] = _rss_bytes()
        fetcher = engine.updater.fetcher  # what this worker fetched, by source (relays, origin)
        if fetcher is not None and dataclasses.is_dataclass(getattr(fetcher, "stats", None)):
            out["fetch"] = dataclasses.asdict(fetcher.stats)
        if digest and engine.views:
            out["digest"] = engine.digest()
            out["engine_digest"] = engine.engine_digest()  # every rank takes part: ask every worker at once
        out["rank"] = engine.updater.ranks.rank
        out["fetched_bytes"] = getattr(engine.updater._sub, "fetched_bytes", None)  # a tensor/expert parallel rank's reads
        out["stage_parts"] = getattr(engine.updater._sub, "stage_parts", None)  # and where its last stage's time went
        return out


def _rss_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
