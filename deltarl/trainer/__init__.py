"""deltarl.trainer: GRPO, models, tasks, BF16 export and publishing (see DESIGN.md).

Modules (none imports torch at import time):

* :mod:`~deltarl.model.tokenizer` - the offline byte tokenizer, local HF tokenizers, ``TokenizerSpec``
* :mod:`~deltarl.model.build` - ``ModelSpec``, ``build_model`` (tiny Qwen3 or a local checkpoint),
  ``export_bf16`` / ``load_bf16_into``, ``RunModelInfo`` (``<run>/model.json``)
* :mod:`~deltarl.model.tasks` - the synthetic addition task and GSM8K/MATH answer checking
* :mod:`~deltarl.trainer.grpo` - ``GRPOConfig``, ``GRPOTrainer.train_step`` -> ``TrainStats``
* :mod:`~deltarl.trainer.loop` - ``TrainerLoop``: open step, wait for rollouts, train, publish
* :mod:`~deltarl.trainer.config` - ``TrainerConfig`` (YAML), the tiny preset ``TINY_GRPO``
* :mod:`~deltarl.trainer.rescore` - ``rescore_rollouts`` for ``deltarl audit --rescore``
"""
