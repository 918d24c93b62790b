"""What the TRL callback costs a training step: its blocking time vs publishing in the step.

A real training loop on CPU (a Qwen3-architecture model, AdamW, lr 1e-5, random token batches)
runs ``--steps`` optimizer steps twice, each arm with its own run in a local store:

* **in the step**: after each optimizer step, ``export_bf16`` then ``Publisher.publish(owned=True)``
  (what a trainer without a background publisher waits for);
* **callback**: ``DeltaRLCallback.on_step_end`` (gather on the training thread, publish on the
  background thread); its blocking time is the gather plus any wait for the previous publish.

Reported per arm: median optimizer-step seconds, median seconds the step is held by publishing,
and the median publish wall time (background in the callback arm). The callback target: held time
<= the gather alone + 10% of the publish, i.e. the publish is hidden behind the next step whenever a
step takes longer than a publish.

    python -m benchmarks.trl_callback [--steps 8] [--hidden 512] [--layers 8] [--quick] [--out FILE]

``--quick`` (a smoke run, seconds): 2 steps of a 2-layer, 64-wide model on 32-token batches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "trl_callback.json"


def _train_step(model: Any, opt: Any, batch: Any) -> float:
    t = time.perf_counter()
    out = model(input_ids=batch, labels=batch)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def run(steps: int, hidden: int, layers: int, batch: int, seq: int) -> dict[str, Any]:
    import torch
    from transformers import TrainerControl, TrainerState

    from deltarl.integrations.trl import DeltaRLCallback
    from deltarl.model.build import ModelSpec, build_model, export_bf16
    from deltarl.pipeline.publisher import Publisher
    from deltarl.storage.open import open_store

    spec = ModelSpec(hidden_size=hidden, intermediate_size=3 * hidden, num_layers=layers, num_heads=8, num_kv_heads=4,
                     max_positions=max(256, seq))
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 259, (batch, seq), generator=gen) for _ in range(steps)]
    out: dict[str, Any] = {"params": None, "steps": steps}
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(tmp)
        for arm in ("in_step", "callback"):
            model = build_model(spec)
            model.train()
            out["params"] = sum(p.numel() for p in model.parameters())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
            train_s, held_s, publish_s, gather_s = [], [], [], []
            if arm == "in_step":
                with Publisher(store, f"bench-{arm}") as pub:
                    pub.publish(export_bf16(model), 0, owned=True)
                    for i, b in enumerate(batches, 1):
                        train_s.append(_train_step(model, opt, b))
                        t = time.perf_counter()
                        info = pub.publish(export_bf16(model), i, owned=True)
                        held_s.append(time.perf_counter() - t)
                        publish_s.append(info.wall_s)
            else:
                cb = DeltaRLCallback(store, f"bench-{arm}")
                state, control = TrainerState(), TrainerControl()
                cb.on_train_begin(None, state, control, model=model)
                for b in batches:
                    train_s.append(_train_step(model, opt, b))
                    state.global_step += 1
                    t = time.perf_counter()
                    cb.on_step_end(None, state, control, model=model)
                    held_s.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    export_bf16(model)  # the gather's own cost on this model, for the target
                    gather_s.append(time.perf_counter() - t)
                cb.close()
                publish_s = [v.wall_s for v in cb.published[1:]]
            out[arm] = {
                "train_s": statistics.median(train_s),
                "held_s": statistics.median(held_s),
                "publish_s": statistics.median(publish_s),
            }
            if gather_s:
                out[arm]["gather_s"] = statistics.median(gather_s)
        store.close()
    cb_arm, step_arm = out["callback"], out["in_step"]
    out["target_held_s"] = cb_arm["gather_s"] + 0.1 * cb_arm["publish_s"]
    out["target_met"] = cb_arm["held_s"] <= out["target_held_s"] or cb_arm["publish_s"] > cb_arm["train_s"]
    out["held_saved_fraction"] = 1 - cb_arm["held_s"] / step_arm["held_s"] if step_arm["held_s"] else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 steps of a tiny model")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.hidden, args.layers, args.batch, args.seq = 2, 64, 2, 2, 32
    res = run(args.steps, args.hidden, args.layers, args.batch, args.seq)
    print(f"model: {res['params'] / 1e6:.1f}M params, {res['steps']} optimizer steps per arm (medians)")
    print(f"{'arm':<10} {'train s':>9} {'held s':>9} {'publish s':>10}")
    for arm in ("in_step", "callback"):
        r = res[arm]
        print(f"{arm:<10} {r['train_s']:9.3f} {r['held_s']:9.3f} {r['publish_s']:10.3f}")
    print(f"callback gather (export) alone: {res['callback']['gather_s']:.3f}s; held target <= "
          f"{res['target_held_s']:.3f}s: {'met' if res['target_met'] else 'NOT met'}; "
          f"step held {100 * res['held_saved_fraction']:.0f}% less than publishing in the step")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "trl_callback", "quick": args.quick, **res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
