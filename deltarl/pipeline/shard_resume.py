"""A sharded job resuming a run: every rank's base rows of the HEAD version, from one replay.

Rank 0 replays the version from the store (verified) and sends each tensor's rows to the rank that
holds them, dropping each full tensor once sent: one process holds the full state for the time of
the resume, not every rank. On gloo the rows go point to point as raw bytes; on other backends
(NCCL) through ``scatter_object_list``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from deltarl.errors import RunError
from deltarl.pipeline.shard_messages import Collectives, ResumeStatus
from deltarl.storage.store import ObjectStore

logger = logging.getLogger(__name__)

#: name -> (first element, local shape) of the rows one rank holds
Want = dict[str, tuple[int, tuple[int, ...]]]

#: backends whose point-to-point calls move CPU tensors
P2P_BACKENDS = frozenset({"gloo"})


def rows_outside(full: Mapping[str, Any], wants: Sequence[Want | None], version: int) -> str | None:
    """Why some rank's rows do not lie inside the replayed tensors (nothing could be sent), or None."""
    for rank, want in enumerate(wants):
        for name, (start, shape) in (want or {}).items():
            if name in full and start + math.prod(shape) > full[name].numel():
                return (f"rank {rank} holds elements [{start}, {start + math.prod(shape)}) of tensor {name!r}, "
                        f"which has {full[name].numel()} at version {version}")
    return None


def resume_rows(comm: Collectives, store: ObjectStore, run: str, version: int, want: Want | None
                ) -> tuple[dict[str, Any] | None, Exception | None]:
    """Collective: this rank's rows of ``version`` (its base) and the error to fail the version with
    on this rank (the replay's, named on every rank), or ``(None, None)`` for a rank that holds no
    rows (its export failed: it takes part and receives nothing)."""
    from deltarl.pipeline.replay import replay

    wants = comm.gather(want)
    full: dict[str, Any] = {}
    status = ResumeStatus(None)
    t0 = time.perf_counter()
    if comm.rank == 0:
        logger.info("run %s: replaying version %d to resume; its rows go to each of %d ranks", run, version, comm.world)
        try:
            full = replay(store, run, version)
            dtypes = {name: str(t.dtype).removeprefix("torch.") for name, t in sorted(full.items())}
            status = ResumeStatus(rows_outside(full, wants or [], version), dtypes)
        except Exception as err:  # every rank fails the version with it
            status = ResumeStatus(f"{type(err).__name__}: {err}")
    status = comm.bcast(status)
    if status.error is not None:
        return None, RunError(f"resuming from version {version}: {status.error}")
    t1 = time.perf_counter()
    mine = _send_rows(comm, full, wants, want, status.dtypes)
    if comm.rank == 0:
        logger.info("run %s: resumed from version %d (replay %.1f s, rows sent in %.1f s)", run, version,
                    t1 - t0, time.perf_counter() - t1)
    if want is None:
        return None, None
    missing = sorted(set(want) - set(mine))
    if missing:
        return None, RunError(f"resuming from version {version}: it has no tensor {missing[0]!r} ({len(missing)} missing)")
    return mine, None


def _send_rows(comm: Collectives, full: dict[str, Any], wants: list[Any] | None, want: Want | None,
               dtypes: dict[str, str]) -> dict[str, Any]:
    """Rank 0 sends each rank its rows of ``full`` (emptied as it goes); every rank returns its own."""
    import torch

    p2p = comm.world > 1 and comm.dist.get_backend(comm.group) in P2P_BACKENDS
    mine: dict[str, Any] = {}
    for name, dtype_name in dtypes.items():
        dtype = getattr(torch, dtype_name)
        if comm.rank == 0:
            assert wants is not None
            flat = full.pop(name).reshape(-1)
            pieces = [None if w is None or name not in w else flat[w[name][0]: w[name][0] + math.prod(w[name][1])]
                      for w in wants]
            if pieces[0] is not None:
                mine[name] = pieces[0].clone().reshape(wants[0][name][1])
            if p2p:
                for r, piece in enumerate(pieces[1:], start=1):
                    if piece is not None and piece.numel():
                        comm.dist.send(piece.contiguous().view(torch.uint8), dst=comm.global_rank(r), group=comm.group)
            elif comm.world > 1:  # clones: a pickled view would carry its whole storage
                inputs = [None, *(None if p is None else p.clone() for p in pieces[1:])]
                comm.dist.scatter_object_list([None], inputs, src=comm.root, group=comm.group)
            del flat, pieces
            continue
        if p2p:
            if want is not None and name in want:
                count = math.prod(want[name][1])
                raw = torch.empty(count * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8)
                if count:
                    comm.dist.recv(raw, src=comm.root, group=comm.group)
                mine[name] = raw.view(dtype).reshape(want[name][1])
        else:
            out: list[Any] = [None]
            comm.dist.scatter_object_list(out, None, src=comm.root, group=comm.group)
            if out[0] is not None:
                mine[name] = out[0].reshape(want[name][1]) if want is not None and name in want else out[0]
    return mine
