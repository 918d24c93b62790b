"""deltarl.integrations: publish the weights of training frameworks that are not deltarl's trainer.

* :mod:`~deltarl.integrations.gather` - a sharded or adapter-wrapped model's full BF16 state on rank 0
  (DeepSpeed ZeRO-3, FSDP, PEFT LoRA merged), every rank joining the collective gather
* :mod:`~deltarl.integrations.trl` - ``DeltaRLCallback``, a ``transformers.TrainerCallback`` (TRL's
  trainers included) that publishes every optimizer step in the background

Nothing here imports torch, transformers or trl at import time.
"""

from __future__ import annotations

from deltarl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "gather": ("gather_bf16",),
})
