"""The publisher's upload side: a bounded pool of in-flight puts, and state copies.

``UploadPool`` keeps at most ``max_in_flight`` objects queued or uploading (so memory holds a few
segments, never the whole delta), fails fast when one upload fails, and measures the time during
which at least one upload was running (the upload critical path of a pipelined publish).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from deltarl.errors import ObjectExists, StoreError, TensorMismatch, WriterConflict
from deltarl.pipeline.manifest import ObjectRef
from deltarl.storage.store import ObjectStore

logger = logging.getLogger(__name__)


def check_materialized(state: Mapping[str, Any]) -> None:
    """TensorMismatch naming the first tensor of ``state`` that holds no values: one on torch's
    ``meta`` device (a model built with ``device="meta"`` or ``init_empty_weights``, never loaded)
    has a shape and a dtype but nothing to copy, hash or publish."""
    for name, value in state.items():
        if getattr(value, "is_meta", False):
            raise TensorMismatch(
                f"tensor {name!r} is on the meta device: it has a shape but no values (a model built on "
                "device='meta' or with init_empty_weights and never loaded); publish tensors that hold values"
            )


def check_readable(state: Mapping[str, Any]) -> None:
    """TensorMismatch naming the first entry of ``state`` the writer could not read as it stands: a
    name that is not a non-empty string, or a CPU tensor (or array) that is not contiguous (the
    encoder and the keyframe writer read each tensor's memory in place). Device tensors are copied
    to the CPU as they are read, so their layout does not matter."""
    for name, value in state.items():
        if not isinstance(name, str) or not name:
            raise TensorMismatch(f"tensor name {name!r}: names must be non-empty strings")
        if isinstance(value, np.ndarray):
            if not value.flags.c_contiguous:
                raise TensorMismatch(f"tensor {name!r} is not C-contiguous (np.ascontiguousarray it, or publish a copy)")
        elif getattr(getattr(value, "device", None), "type", None) == "cpu" and not value.is_contiguous():
            raise TensorMismatch(f"tensor {name!r} is not contiguous (.contiguous() it, or publish a copy)")


def cpu_copy(value: Any) -> Any:
    """A private, contiguous CPU copy of one state value (torch tensor or numpy array)."""
    if isinstance(value, np.ndarray):
        return np.array(value, copy=True, order="C")
    if hasattr(value, "bits"):  # codec.BF16
        return type(value)(np.array(value.bits, copy=True, order="C"))
    return value.detach().to("cpu", copy=True).contiguous()


def as_torch(value: Any) -> Any:
    """``value`` as a contiguous CPU torch tensor (a ``BF16`` bit view becomes bfloat16)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous()
    if hasattr(value, "bits"):
        return torch.from_numpy(np.ascontiguousarray(value.bits)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(value))


def copy_into(dst: Any, src: Any, name: str) -> None:
    from deltarl.codec.tensors import flat_bits, is_cuda

    if is_cuda(src):
        src = src.cpu()
    np.copyto(flat_bits(name, dst, writable=True), flat_bits(name, src))


class UploadPool:
    """A bounded set of in-flight uploads; tracks the time at least one was running."""

    def __init__(self, pool: ThreadPoolExecutor, max_in_flight: int) -> None:
        self.pool = pool
        self.slots = threading.BoundedSemaphore(max_in_flight)
        self.lock = threading.Lock()
        self.futures: list[Future[ObjectRef]] = []
        self.running = 0
        self.busy_since = 0.0
        self.busy_s = 0.0
        self.done = 0

    def submit(self, fn: Any, *args: Any) -> None:
        self.slots.acquire()
        for f in self.futures:  # fail fast: stop encoding as soon as one upload failed
            if f.done() and f.exception() is not None:
                self.slots.release()
                f.result()
        try:
            self.futures.append(self.pool.submit(self._run, fn, *args))
        except BaseException:
            self.slots.release()
            raise

    def _run(self, fn: Any, *args: Any) -> ObjectRef:
        with self.lock:
            if self.running == 0:
                self.busy_since = time.perf_counter()
            self.running += 1
        try:
            return fn(*args)
        finally:
            with self.lock:
                self.running -= 1
                self.done += 1
                if self.running == 0:
                    self.busy_s += time.perf_counter() - self.busy_since
            self.slots.release()

    def results(self) -> list[ObjectRef]:
        """Wait for all; raise the first failure (after every upload has finished)."""
        errors = []
        refs = []
        for f in self.futures:
            err = f.exception()
            if err is not None:
                errors.append(err)
            else:
                refs.append(f.result())
        if errors:
            raise errors[0]
        return refs


def upload_object(store: ObjectStore, key: str, data: bytes, piece_size: int) -> ObjectRef:
    """Put ``data`` at ``key`` if absent and return its ref. The key carries the writer's epoch, so
    an existing object is this writer's own write retried (the same bytes: fine) or a conflict."""
    ref = ObjectRef.of(key, data, piece_size=piece_size)
    try:
        store.put_if_absent(key, data)
    except ObjectExists as err:
        if store.get(key) != data:
            raise WriterConflict(f"{key} already exists with other bytes: another writer is publishing this run") from err
    return ref


def discard(store: ObjectStore, uploads: UploadPool) -> None:
    """After a failed publish: wait for the pool's uploads and delete what they wrote (best effort;
    what is left is swept by gc or the next writer)."""
    futures, uploads.futures = uploads.futures, []
    for f in futures:
        if f.exception() is None:
            key = f.result().key
            try:
                store.delete(key)
            except StoreError as err:
                logger.warning("could not delete %s after a failed publish (gc will): %s", key, err)
