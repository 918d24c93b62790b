"""Publish every optimizer step of a TRL ``GRPOTrainer`` with deltarl: a complete run on one CPU.

    pip install 'deltarl[torch,trl]'
    python examples/trl_grpo.py --store ./deltarl-runs --run trl-demo --steps 3
    deltarl inspect trl-demo --store ./deltarl-runs

The model is deltarl's tiny Qwen3, built from a config (``ModelSpec()``), and the tokenizer an
offline Hugging Face byte tokenizer (``save_hf_byte_tokenizer``) whose ids are deltarl's byte
tokenizer's, so ``<run>/model.json`` records ``TokenizerSpec(kind="byte")`` and actors need no file
of this machine: nothing is downloaded. For a real run, build ``model`` and ``tokenizer`` from your
checkpoint and record its path, ``ModelSpec(name="/ckpt/qwen3-8b")`` and
``TokenizerSpec(kind="hf", path="/ckpt/qwen3-8b")``: what actors rebuild.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from deltarl.exposition import MetricsServer
from deltarl.integrations.trl import DeltaRLCallback
from deltarl.model.build import ModelSpec, build_model
from deltarl.model.hf_byte import save_hf_byte_tokenizer
from deltarl.model.record import RunModelInfo
from deltarl.model.tokenizer import TokenizerSpec
from deltarl.trainer.metrics import TrainerMetrics


def reward_digits(completions: list[str], **_: object) -> list[float]:
    """A toy reward with some spread (more 1s than 0s), so GRPO's advantages are not all zero."""
    return [float(c.count("1") - c.count("0")) for c in completions]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--store", default="./deltarl-runs", help="store URL (a folder, s3://bucket/prefix, ...)")
    parser.add_argument("--run", default="trl-demo", help="run name in the store")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (one version each)")
    parser.add_argument("--lr", type=float, default=5e-6,
                        help="learning rate (default 5e-6: the sparse regime, a few %% of elements change per version)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics here (0: any port)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="deltarl-trl-") as work:
        tok_dir = save_hf_byte_tokenizer(Path(work) / "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
        spec = ModelSpec()  # the tiny Qwen3; ModelSpec(name="/ckpt/qwen3-8b") for a checkpoint
        model = build_model(spec)
        info = RunModelInfo(model=spec, tokenizer=TokenizerSpec(kind="byte"), max_new_tokens=8)  # what actors rebuild

        metrics = TrainerMetrics()
        server = MetricsServer(metrics.registry, port=args.metrics_port) if args.metrics_port is not None else None
        callback = DeltaRLCallback(args.store, args.run, model_info=info, on_published=metrics.published,
                                   publisher_options={"keyframe_interval": 2})
        config = GRPOConfig(
            output_dir=str(Path(work) / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=4,
            num_generations=4, max_completion_length=8, max_steps=args.steps, learning_rate=args.lr, seed=0,
            report_to="none", save_strategy="no", disable_tqdm=True,
        )  # fmt: skip
        dataset = Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(8)]})
        trainer = GRPOTrainer(model=model, reward_funcs=reward_digits, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[callback])
        try:
            trainer.train()  # version 0 at the start, then one version per optimizer step
        finally:
            callback.close()  # waits for the last publish and releases the writer claim
            if server is not None:
                server.close()
    for v in callback.published:
        print(f"{args.run} version {v.version} (step {v.step}): {v.version_id[:16]}…")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
