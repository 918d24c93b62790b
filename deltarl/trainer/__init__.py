"""deltarl.trainer: GRPO against the coordinator, publishing every version (none imports torch at import time).

* :mod:`~deltarl.trainer.grpo` - ``GRPOConfig``, ``GRPOTrainer.train_step`` -> ``TrainStats``
* :mod:`~deltarl.trainer.warmup` - ``WarmupConfig``, the supervised warm-up before GRPO (cached per config)
* :mod:`~deltarl.trainer.loop` - ``TrainerLoop``: (warm up,) open step, wait for rollouts, train, publish
* :mod:`~deltarl.trainer.config` - ``TrainerConfig`` (YAML; its ``publish:`` is a ``PublishConfig``), the presets ``tiny`` (``TINY_GRPO``, from
  scratch) and ``sparse`` (the demo's: warm-up, then GRPO at a small lr)
* :mod:`~deltarl.trainer.rescore` - ``rescore_rollouts`` for ``deltarl audit --rescore``

Models, tokenizers and tasks are :mod:`deltarl.model`.
"""

from __future__ import annotations

from deltarl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "config": ("TrainerConfig",),
    "loop": ("TrainerLoop",),
    "grpo": ("GRPOTrainer",),
})
