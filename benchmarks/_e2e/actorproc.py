"""One actor of the full-size run, in its own process: its own copy of the model (one flat BF16
buffer), its own fetcher (its region's relay first, the origin across its WAN link second), and the
step loop of ``driver.py`` run locally against the wall clock.

    python -m benchmarks._e2e.actorproc '<json config>'

Lines out (JSON): ``ready`` (state loaded), ``bootstrapped`` (a joiner's keyframe + deltas are
in), ``end`` (one window done, with its start, wait and the version it ran on), ``done`` (final
version, state digest, when each version was staged, commit pauses, CPU seconds, peak RSS, bytes
fetched per source). Lines in: ``{"go": 1}`` starts the loop; closing stdin ends the process.

Modes: ``deltarl`` (the real :class:`~deltarl.actor.subscriber.Subscriber`: long-poll, multi-stream
fetch, decode into a stager as segments arrive, commit in place) and ``full`` (the whole BF16 state
every version, every shard fetched on several streams straight into a staging buffer, copied in at
the boundary). The staging buffer of ``full`` is a file-backed shared mapping so two actors' second
copies can be written back and evicted under memory pressure on a shared machine (its resident
pages still count in VmHWM).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._scale_state import MODELS, load_state, qwen3_specs, rss_bytes, views
from deltarl.actor.fetcher import Fetcher
from deltarl.codec import state_digest
from deltarl.errors import ObjectNotFound, TransferError
from deltarl.pipeline.manifest import ObjectRef

from .modes import Actor, DeltaActor, full_index_key


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _bits(flat: Any) -> np.ndarray:
    import torch

    return flat.view(torch.int16).numpy().view(np.uint16)


class SubActor(DeltaActor):
    """deltarl: a Subscriber over the region's fetcher (a joiner bootstraps first)."""

    async def bootstrap(self) -> int:
        info = await self.sub.bootstrap()
        self.version = info.version
        self.staged_at[info.version] = time.monotonic()
        return info.version


class FlatFullActor(Actor):
    """Full broadcast: each version's shards fetched concurrently straight into one staging buffer."""

    def __init__(self, name: str, bits: np.ndarray, run: str, fetcher: Fetcher, staging: Path, *, poll_wait_s: float) -> None:
        super().__init__(name)
        self.bits, self.run, self.fetcher, self.poll_wait_s = bits, run, fetcher, poll_wait_s
        self._buf = np.memmap(staging, dtype=np.uint8, mode="w+", shape=(bits.nbytes,))
        self._staged: int | None = None
        self._free = asyncio.Event()
        self._free.set()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        version = self.version + 1
        view = memoryview(self._buf)
        while True:
            await self._free.wait()
            try:
                index = json.loads(await self.fetcher.fetch_key(full_index_key(self.run, version), wait_s=self.poll_wait_s))
            except (ObjectNotFound, TransferError):
                continue
            step = index["shard_bytes"]
            refs = [ObjectRef.from_obj(r, where="index") for r in index["shards"]]
            await asyncio.gather(*(self.fetcher.fetch_into(r, [(0, view[i * step : i * step + r.size])]) for i, r in enumerate(refs)))
            self._staged = version
            self._free.clear()
            self._mark_staged(version)
            version += 1

    def staged(self) -> int | None:
        return self._staged

    def commit(self) -> None:
        assert self._staged is not None
        t0 = time.perf_counter()
        np.copyto(self.bits, self._buf.view(np.uint16))
        self.version, self._staged = self._staged, None
        self.pauses.append(time.perf_counter() - t0)
        self._free.set()


def emit(**msg: Any) -> None:
    print(json.dumps(msg), flush=True)


async def main(cfg: dict[str, Any]) -> None:
    import torch

    scratch, model = Path(cfg["scratch"]), cfg["model"]
    t0 = time.monotonic()
    specs = qwen3_specs(MODELS[model])
    if cfg.get("join"):  # the model this actor built before joining; the keyframe loads straight into it
        flat = torch.zeros(sum(s.numel for s in specs), dtype=torch.bfloat16)
        state = views(flat, specs)
    else:
        flat, state = load_state(scratch, model, 0)
    from deltarl.codec.jit_warmup import warm_codec

    warm_codec(["bfloat16"])  # numba's compiled kernels loaded before the clock, as the trainer's are
    fetcher = Fetcher(cfg["sources"], streams=cfg["streams"], range_bytes=cfg["range_bytes"], read_timeout_s=120)
    actor: SubActor | FlatFullActor
    if cfg["mode"] == "full":
        actor = FlatFullActor(cfg["name"], _bits(flat), cfg["run"], fetcher, Path(cfg["staging"]), poll_wait_s=30.0)
    else:
        actor = SubActor(cfg["name"], state, cfg["run"], fetcher, None if cfg.get("join") else cfg["vid0"], poll_wait_s=30.0)
    emit(ready=True, load_s=time.monotonic() - t0, rss=rss_bytes("VmRSS"))
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    go = json.loads(await reader.readline())
    c0, go_at = _cpu(), time.monotonic()
    first = int(go.get("first_window", 0))
    if isinstance(actor, SubActor) and cfg.get("join"):
        v = await actor.bootstrap()
        emit(bootstrapped=time.monotonic(), go_at=go_at, version=v, bytes_by_source=dict(fetcher.stats.bytes_by_source))
    await actor.start()
    lag, gen_s, prev_end = cfg["lag"], cfg["gen_s"], time.monotonic()
    for k in range(first, cfg["windows"]):
        await actor.advance_to(max(0, k - lag))
        start = time.monotonic()
        end = start + gen_s * cfg.get("slowdown", 1.0)
        emit(start=k, t=start, version=actor.version)
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        emit(end=k, t=end, start_t=start, wait=start - prev_end, version=actor.version)
        prev_end = end
    cpu = _cpu() - c0
    await actor.close()
    await fetcher.close()
    digest = await asyncio.to_thread(state_digest, state)
    emit(done=True, version=actor.version, digest=digest, staged_at={str(v): t for v, t in actor.staged_at.items()},
         pauses=actor.pauses, cpu_s=cpu, peak_rss=rss_bytes("VmHWM"), go_at=go_at,
         bytes_by_source=dict(fetcher.stats.bytes_by_source), failovers=fetcher.stats.failovers, retries=fetcher.stats.retries)  # fmt: skip
    while await reader.readline():
        pass


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
