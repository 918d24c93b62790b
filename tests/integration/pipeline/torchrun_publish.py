"""A sharded trainer as users launch one: ``torchrun --nproc_per_node N torchrun_publish.py OUT``.

FSDP2 on the tiny Qwen3 (gloo, CPU); every optimizer step is published in the background with
``ShardedPublisher.publish_model_async`` on a gloo group of its own while the next step trains;
rank 0 saves each version's gathered BF16 state for the test to compare replays against.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(out: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from deltarl.model.build import ModelSpec, build_model
    from deltarl.pipeline.sharded import ShardedPublisher
    from deltarl.storage import LocalStore
    from deltarl.testing.ranks import leave_process_group, traceback_to

    rank = int(os.environ["RANK"])
    with traceback_to(Path(out, f"error-{rank}.txt")):
        torch.set_num_threads(1)
        dist.init_process_group("gloo")  # rank, world and rendezvous from torchrun's environment
        model = build_model(ModelSpec(seed=0))
        model.train()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        group = dist.new_group(backend="gloo")
        with ShardedPublisher(LocalStore(os.path.join(out, "store")), "r", group=group, keyframe_interval=3,
                              digest_interval=2, segment_bytes=8192) as pub:
            for step in range(steps):
                if step:
                    ids = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(step))
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
                pub.publish_model_async(model, step)  # this rank's shard copied; the rest runs behind
                full = {n: p.full_tensor().detach().to(torch.bfloat16) for n, p in model.named_parameters()}
                if rank == 0:
                    torch.save(full, os.path.join(out, f"full-{step}.pt"))
            info = pub.wait()
            if info is None or info.version != steps - 1:
                raise RuntimeError(f"the last background publish is {info}, not version {steps - 1}")
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
