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

#: Public name -> the module that defines it (imported on first use: ``import deltarl.model`` stays light).
_EXPORTS = {
    "ModelSpec": "deltarl.model.build",
    "RunModelInfo": "deltarl.model.record",
    "TaskSpec": "deltarl.model.tasks",
    "TokenizerSpec": "deltarl.model.tokenizer",
    "build_model": "deltarl.model.build",
    "build_task": "deltarl.model.tasks",
    "export_bf16": "deltarl.model.build",
    "load_bf16_into": "deltarl.model.build",
    "load_tokenizer": "deltarl.model.tokenizer",
    "read_model_json": "deltarl.model.record",
    "write_model_json": "deltarl.model.record",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
