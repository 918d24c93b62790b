"""The full-size run's network and trainer state: real relay processes, kernel-shaped links, and the
trainer's versions as file-backed BF16 buffers.

::

    trainer (this process) ─put─▶ origin store (local dir)
        origin relay: a ``deltarl relay`` process inside the origin network namespace
            ▲ veth r, shaped by tbf (rate), one per actor region
            │ link emulator process: EmulatedLink r (delay RTT/2 each way, per-connection window)
        region relay r: a ``deltarl relay`` process (cut-through, long-poll, disk cache)
            ▲ loopback (the region's LAN)
        actor process r (fetcher: its relay first, the origin across the WAN link second)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._scale_state import MODELS, apply_changes, qwen3_specs, views

from .netns import ShapedRegions
from .procs import Child, RelayProc, proc_rss


@dataclass
class FullRegion:
    name: str
    relay: RelayProc
    link_url: str

    @property
    def sources(self) -> list[str]:
        return [self.relay.url, self.link_url]


class FullNetwork:
    """``async with FullNetwork(root, regions, rate_bps=..., rtt_s=..., window_bytes=...)``."""

    def __init__(self, root: Path, regions: int, *, rate_bps: float, rtt_s: float, window_bytes: int, piece_bytes: int = 1 << 20) -> None:
        self.root, self.n, self.rate_bps, self.rtt_s, self.window_bytes = root, regions, rate_bps, rtt_s, window_bytes
        self.piece_bytes = piece_bytes
        self.origin_dir = root / "origin"
        self.regions: list[FullRegion] = []
        self.origin_relay: RelayProc | None = None
        self.links: Child | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> FullNetwork:
        self.origin_dir.mkdir(parents=True, exist_ok=True)
        shaped = ShapedRegions(self.n, self.rate_bps).up()
        self._stack.callback(shaped.down)
        self.origin_relay = RelayProc("origin", str(self.origin_dir), self.root / "cache-origin", listen="0.0.0.0:0", netns=shaped.ns,
                                      piece_bytes=self.piece_bytes)  # fmt: skip
        self._stack.callback(self.origin_relay.close)
        self.links = Child("links", "benchmarks._e2e.linkproc", {
            "targets": [[shaped.origin_ip(i), self.origin_relay.port] for i in range(self.n)],
            "rtt_s": self.rtt_s, "window_bytes": self.window_bytes,
        })  # fmt: skip
        ready = await self.links.start()
        self._stack.push_async_callback(self.links.close)
        for i, url in enumerate(ready["urls"]):
            name = f"region-{i + 1}"
            relay = RelayProc(name, url, self.root / f"cache-{name}", piece_bytes=self.piece_bytes)
            self._stack.callback(relay.close)
            self.regions.append(FullRegion(name, relay, url))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def link_bytes(self) -> dict[str, int]:
        assert self.links is not None
        self.links.send(stats=1)
        msg = await self.links.expect("stats", timeout=30)
        return {r.name: down + up for r, (down, up) in zip(self.regions, msg["stats"], strict=True)}

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of the network's processes, by role."""
        assert self.origin_relay is not None
        assert self.links is not None
        out = {"origin_relay": self.origin_relay.cpu_s(), "links": self.links.cpu_s()}
        for r in self.regions:
            out[f"relay:{r.name}"] = r.relay.cpu_s()
        return out

    def peak_rss(self) -> dict[str, int]:
        assert self.origin_relay is not None
        assert self.links is not None
        out = {"origin_relay": self.origin_relay.peak_rss(), "links": proc_rss(self.links.pid)}
        for r in self.regions:
            out[f"relay:{r.name}"] = r.relay.peak_rss()
        return out


def _file_backed(path: Path, total: int) -> Any:
    import torch

    return torch.from_file(str(path), shared=True, size=total, dtype=torch.bfloat16)


class TrainerVersions:
    """The trainer's exports, version by version: each a file-backed (MAP_SHARED) BF16 buffer, made
    from the previous one plus the version's changes (``_scale_state``: Adam at lr 1e-6 moves ~1% of
    the BF16 weights by one ulp). File-backed, so the trainer's two copies (the base the publisher
    keeps and the new export) are page cache the kernel may write back, not anonymous memory on a
    machine shared with the actors. Version ``v`` uses ``work-{v % 3}.bin``: the publisher let go of
    version ``v - 3`` two versions ago."""

    def __init__(self, scratch: Path, model: str, work: Path) -> None:
        self.scratch, self.model, self.work = scratch, model, work
        self.specs = qwen3_specs(MODELS[model])
        self.total = sum(s.numel for s in self.specs)
        work.mkdir(parents=True, exist_ok=True)

    def load(self, version: int) -> tuple[Any, dict[str, Any]]:
        """Build version ``version`` from version ``version - 1`` (version 0: the generated state)."""
        import torch

        if version == 0:
            flat = _file_backed(self.scratch / "v0.bin", self.total)
            return flat, views(flat, self.specs)
        src = self.scratch / "v0.bin" if version == 1 else self.work / f"work-{(version - 1) % 3}.bin"
        dst = self.work / f"work-{version % 3}.bin"
        shutil.copyfile(src, dst)
        flat = _file_backed(dst, self.total)
        apply_changes(flat.view(torch.int16).numpy().view(np.uint16), self.scratch, version)
        return flat, views(flat, self.specs)

    def cleanup(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def flat_bits(flat: Any) -> np.ndarray:
    import torch

    return flat.view(torch.int16).numpy().view(np.uint16)


def shards(nbytes: int, shard_bytes: int) -> Iterator[tuple[int, int]]:
    for i in range(-(-nbytes // shard_bytes)):
        yield i * shard_bytes, min(nbytes, (i + 1) * shard_bytes)


class FlatFullPublisher:
    """Full broadcast from one flat buffer: shards (views, no serialization copy) hashed and
    uploaded in parallel, then the index."""

    def __init__(self, store: Any, run: str, *, shard_bytes: int, workers: int = 4) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.store, self.run, self.shard_bytes = store, run, shard_bytes
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="full-upload")

    def publish(self, flat: Any, version: int) -> dict[str, Any]:
        from deltarl.pipeline.manifest import ObjectRef

        from .modes import full_index_key

        t0 = time.perf_counter()
        raw = memoryview(flat_bits(flat).view(np.uint8))
        prefix = f"{self.run}/full/{version:012d}/"

        def put(i_span: tuple[int, tuple[int, int]]) -> Any:
            i, (a, b) = i_span
            key = f"{prefix}shard-{i:05d}.bin"
            self.store.put_if_absent(key, raw[a:b])
            return ObjectRef.of(key, raw[a:b])

        refs = list(self._pool.map(put, enumerate(shards(len(raw), self.shard_bytes))))
        index = {"version": version, "shard_bytes": self.shard_bytes, "shards": [r.to_obj() for r in refs]}
        self.store.put_if_absent(full_index_key(self.run, version), json.dumps(index).encode())
        return {"bytes": len(raw), "objects": len(refs), "wall_s": time.perf_counter() - t0}

    def close(self) -> None:
        self._pool.shutdown(wait=True)


async def sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
