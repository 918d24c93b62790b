"""Generation backends: one adapter file each (``hf``, ``vllm``) and their table by name
(:mod:`deltarl.actor.backends.table`), which the actor, its config, its command and the demo read."""
