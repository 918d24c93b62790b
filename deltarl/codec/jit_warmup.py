"""Warm the codec before the first real delta: numba loads each compiled signature from its cache
on first call (~0.3 s in all), so a publisher or a bootstrap pays it on a worker thread while it
waits for other things (the trainer's step, the keyframe) instead of inside its first version.

``python -m deltarl.codec.jit_warmup`` compiles every width's kernels into numba's cache at once
(about two core-minutes on a fresh install; well under a second once cached): an image build or
a test run starting many processes does it once, before they start, instead of in each of them.
numba keeps one cache per source file for one numba version (``NUMBA_CACHE_DIR`` moves it)."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from deltarl.codec import kernels
from deltarl.codec.tensors import DTYPES, flat_bits

log = logging.getLogger(__name__)

#: Elements of the warm-up tensors, cut into 16 chunks (so the paired decoder runs too).
_ELEMENTS = 1 << 18
_SEGMENT_BYTES = 1 << 16
_BASE = "0" * 64


def warm_codec(dtypes: Iterable[str], *, stop: threading.Event | None = None) -> None:
    """Encode, check, stage, commit and roll back tiny deltas of each raw width the run's ``dtypes`` use (16 bits
    for bfloat16/float16, 32 for float32, 8 for the FP8 dtypes), at 0.02%, 1% and wholly changed (the ``sparse``, ``ctx`` and ``dense``
    codecs ``auto`` picks from), and at 1% in grid cells coded ``ctxs``; nothing is kept. Only those widths and codecs: on a fresh install numba
    compiles each signature on first use, and one the run never uses would cost seconds (all of them, a minute on
    two cores). ``stop``: set it to end the warm-up at the next step (a compile already under way finishes first:
    numba cannot be interrupted), so an owner closing early does not wait for every signature."""
    from deltarl.codec.encode import iter_encode_delta
    from deltarl.codec.stager import stage_delta

    if kernels.jit() is None:
        return  # the numpy path has nothing to load
    widths = {DTYPES[d][1] for d in dtypes if d in DTYPES}
    rng = np.random.default_rng(0)
    for width in sorted(widths & {8, 16, 32}):
        old = {"w": _tensor(width, rng)}
        for every, codec in ((4099, "auto"), (97, "auto"), (1, "auto"), (97, "ctxs")):  # sparse, ctx, dense; cells' ctxs
            if stop is not None and stop.is_set():
                log.debug("codec warm-up stopped before %d-bit %s 1/%d", width, codec, every)
                return
            t0 = time.perf_counter()
            new = {"w": _nudged(old["w"], every)}
            segments = list(iter_encode_delta(old, new, base=_BASE, segment_bytes=_SEGMENT_BYTES, check_finite=True,
                                              codec=codec))  # fmt: skip
            staged = stage_delta(old, segments, base=_BASE)
            staged.commit()  # the commit and rollback kernels too: else the first real pause loads them
            staged.rollback()
            log.debug("codec warm-up: %d-bit %s 1/%d in %.2fs", width, codec, every, time.perf_counter() - t0)


def _tensor(width: int, rng: np.random.Generator) -> Any:
    """A warm-up tensor of ``width``-bit elements (8-bit: a torch float8 tensor of finite codes)."""
    if width == 8:
        import torch

        return torch.from_numpy(rng.integers(0, 0x7E, _ELEMENTS, dtype=np.uint8)).view(torch.float8_e4m3fn)
    return rng.standard_normal(_ELEMENTS).astype(np.float16 if width == 16 else np.float32)


def _nudged(value: Any, every: int) -> Any:
    """A copy of ``value`` with every ``every``-th element one code or ULP up."""
    if isinstance(value, np.ndarray):
        out = value.copy()
        out[::every] = np.nextafter(out[::every], np.inf)
        return out
    out = value.clone()
    flat_bits("w", out, writable=True)[::every] += 1
    return out


def warm_codec_quietly(dtypes: Iterable[str], *, stop: threading.Event | None = None) -> None:
    """:func:`warm_codec` for a background thread: a failure is logged, never raised (the first real
    delta then loads the kernels itself, and reports any real problem)."""
    try:
        warm_codec(dtypes, stop=stop)
    except Exception as err:
        log.warning("codec warm-up failed (the first delta loads the kernels instead): %s", err)


def compile_codec(dtypes: Iterable[str] = tuple(DTYPES)) -> float | None:
    """:func:`warm_codec` for ``dtypes`` (default: every dtype the codec takes), in this thread, under
    an exclusive lock on numba's cache of the codec (:func:`cache_lock`), so processes that call it at
    once (two test suites starting together, containers sharing a volume) compile each kernel once and
    never write one cache index at once; the seconds it took, waiting included, or None where numba is
    not installed (the numpy path compiles nothing)."""
    if kernels.jit() is None:
        return None
    t0 = time.perf_counter()
    with cache_lock():
        warm_codec(dtypes)
    return time.perf_counter() - t0


def cache_dir() -> Path:
    """Where numba caches the codec's kernels: ``NUMBA_CACHE_DIR`` if set, else the codec's
    ``__pycache__`` (numba's default for a writable source tree)."""
    root = os.environ.get("NUMBA_CACHE_DIR")
    here = Path(kernels.__file__).resolve().parent
    return Path(root) / here.relative_to(here.anchor) if root else here / "__pycache__"


@contextlib.contextmanager
def cache_lock() -> Iterator[None]:
    """An exclusive ``flock`` on a file in :func:`cache_dir` (one host; numba takes no lock of its own
    when it writes its cache): a second holder waits, then loads what the first compiled."""
    path = cache_dir() / "deltarl-jit-warmup.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is compiling the codec's kernels (%s): waiting for it", path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def main(argv: list[str] | None = None) -> None:
    """Compile (or load) the codec's kernels for ``--dtypes`` (default: every dtype the codec takes)."""
    parser = argparse.ArgumentParser(description="compile the codec's numba kernels into numba's cache")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated dtypes (default: all)")
    took = compile_codec(parser.parse_args(argv).dtypes.split(","))
    print("numba is not installed: the codec runs its numpy path, nothing to compile" if took is None
          else f"codec kernels ready in {took:.1f}s")


__all__ = ["cache_dir", "cache_lock", "compile_codec", "main", "warm_codec", "warm_codec_quietly"]


if __name__ == "__main__":
    main()
