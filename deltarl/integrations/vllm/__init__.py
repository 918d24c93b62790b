"""deltarl inside vLLM: the ``deltarl`` weight-transfer backend.

Installing ``deltarl[vllm]`` registers it (entry point ``vllm.general_plugins``, :mod:`.plugin`);
start vLLM with ``weight_transfer_config={"backend": "deltarl"}`` (and, to read the served
version back, ``worker_extension_cls=WORKER_EXTENSION``: :data:`ENGINE_KWARGS` holds both). Each
worker then reads the run itself, decodes every version against its live parameters and commits
it in place (:mod:`.engine`), with checkpoint names mapped through the model's own
``load_weights`` (:mod:`deltarl.updater.probe`). :func:`attach`, :func:`update` and :func:`status` drive it
from the process holding the ``vllm.LLM``. Nothing here imports vLLM until vLLM loads the engine.
"""

from __future__ import annotations

from deltarl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "client": ("ENGINE_KWARGS", "LLMSyncClient", "attach", "update", "status"),
})
