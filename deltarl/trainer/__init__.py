"""deltarl.trainer: GRPO, models, tasks, BF16 export and publishing (see DESIGN.md).

Modules (none imports torch at import time):

* :mod:`~deltarl.model.tokenizer` - the offline byte tokenizer, local HF tokenizers, ``TokenizerSpec``
* :mod:`~deltarl.model.build` - ``ModelSpec``, ``build_model`` (tiny Qwen3 or a local checkpoint),
  ``export_bf16`` / ``load_bf16_into``, ``RunModelInfo`` (``<run>/model.json``)
* :mod:`~deltarl.model.tasks` - the synthetic addition task and GSM8K/MATH answer checking
* :mod:`~deltarl.trainer.grpo` - ``GRPOConfig``, ``GRPOTrainer.train_step`` -> ``TrainStats``
* :mod:`~deltarl.trainer.warmup` - ``WarmupConfig``, the supervised warm-up before GRPO (cached per config)
* :mod:`~deltarl.trainer.loop` - ``TrainerLoop``: (warm up,) open step, wait for rollouts, train, publish
* :mod:`~deltarl.trainer.config` - ``TrainerConfig`` (YAML), the presets ``tiny`` (``TINY_GRPO``, from
  scratch) and ``sparse`` (the demo's: warm-up, then GRPO at a small lr)
* :mod:`~deltarl.trainer.rescore` - ``rescore_rollouts`` for ``deltarl audit --rescore``
"""
