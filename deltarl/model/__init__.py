"""deltarl.model: what a policy is, shared by the trainer, actors and audits.

* :mod:`~deltarl.model.build` - ``ModelSpec``, ``build_model`` (tiny Qwen3 or a local checkpoint),
  ``export_bf16`` / ``load_bf16_into``
* :mod:`~deltarl.model.tokenizer` - the offline byte tokenizer, local HF tokenizers, ``TokenizerSpec``
* :mod:`~deltarl.model.tasks` - the synthetic addition task and GSM8K/MATH answer checking
* :mod:`~deltarl.model.record` - ``RunModelInfo``, the run's ``model.json``

Nothing here imports torch at import time.
"""

from __future__ import annotations

from deltarl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "build": ("ModelSpec", "export_bf16"),
    "record": ("RunModelInfo", "write_model_json"),
    "tokenizer": ("TokenizerSpec",),
})
