"""Staging prepares the commit: 8 bytes of host memory per BF16 change, and the torch scatter path
(CUDA's, run here on CPU torch tensors) gives the same bits, refusals and rollbacks as the numpy one."""

from __future__ import annotations

import numpy as np
import pytest

from deltarl.codec import encode_delta, stage_delta, state_digest
from deltarl.errors import StagingError, TensorMismatch

torch = pytest.importorskip("torch")


def _states(seed: int = 0) -> tuple[dict[str, object], dict[str, object]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"a.weight": (300, 257), "b.bias": (4099,), "c.weight": (64, 1024)}
    old = {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}
    new = {}
    for k, v in old.items():
        bits = v.view(torch.int16).clone()
        mask = torch.rand(v.shape, generator=g) < 0.02
        step = torch.randint(-2, 3, v.shape, generator=g, dtype=torch.int16)
        bits[mask] += step[mask]
        new[k] = bits.view(torch.bfloat16)
    return old, new


def _clone(state: dict[str, object]) -> dict[str, object]:
    return {k: v.clone() for k, v in state.items()}  # type: ignore[attr-defined]


@pytest.mark.parametrize("torch_scatter", [False, True])
def test_commit_rollback_idempotent_on_both_paths(torch_scatter: bool) -> None:
    old, new = _states()
    segs = encode_delta(old, new, base="p", segment_bytes=1024)
    assert len(segs) > 1
    state = _clone(old)
    upd = stage_delta(state, segs, base="p", torch_scatter=torch_scatter)
    assert state_digest(state) == state_digest(old)  # staging writes nothing
    assert (upd.host_bytes == 0) == torch_scatter  # the torch path holds its changes as torch tensors
    upd.commit()
    upd.commit()
    assert state_digest(state) == state_digest(new)
    upd.rollback()
    assert state_digest(state) == state_digest(old)
    upd.commit()
    assert state_digest(state) == state_digest(new)


def test_staging_holds_eight_bytes_per_bf16_change() -> None:
    old, new = _states(1)
    upd = stage_delta(_clone(old), encode_delta(old, new, base="p", segment_bytes=4096), base="p")
    assert upd.changed_elements > 1000
    assert upd.host_bytes == 8 * upd.changed_elements  # uint32 position + new bits + old bits
    for name, (pos, o, n) in upd.changes().items():
        a = old[name].view(torch.int16).numpy().view(np.uint16).reshape(-1)  # type: ignore[attr-defined]
        b = new[name].view(torch.int16).numpy().view(np.uint16).reshape(-1)  # type: ignore[attr-defined]
        want = np.flatnonzero(a != b)
        assert np.array_equal(pos, want)
        assert np.array_equal(o, a[want])
        assert np.array_equal(n, b[want])


@pytest.mark.parametrize("torch_scatter", [False, True])
def test_refused_commit_never_half_applies(torch_scatter: bool) -> None:
    old, new = _states(2)
    segs = encode_delta(old, new, base="p", segment_bytes=4096)
    state = _clone(old)
    upd = stage_delta(state, segs, base="p", torch_scatter=torch_scatter)
    pos, o, _ = upd.changes()["c.weight"]
    flat = state["c.weight"].view(-1).view(torch.int16)  # type: ignore[attr-defined]
    flat[int(pos[-1])] = int(np.int16(o[-1] ^ 0x40))  # neither old nor new: the state moved on
    before = _clone(state)
    with pytest.raises(StagingError, match=r"c\.weight"):
        upd.commit()
    assert state_digest(state) == state_digest(before)


@pytest.mark.parametrize("torch_scatter", [False, True])
def test_replaced_tensor_is_rebound_or_refused(torch_scatter: bool) -> None:
    old, new = _states(3)
    segs = encode_delta(old, new, base="p", segment_bytes=4096)
    state = _clone(old)
    upd = stage_delta(state, segs, base="p", torch_scatter=torch_scatter)
    state["a.weight"] = old["a.weight"].clone()  # type: ignore[attr-defined]  # same spec, new memory
    upd.commit()
    assert state_digest(state) == state_digest(new)
    state["b.bias"] = torch.zeros(5, dtype=torch.bfloat16)
    with pytest.raises(TensorMismatch, match=r"b\.bias"):
        upd.rollback()


def test_a_tensor_changed_under_the_same_object_is_looked_at_again() -> None:
    """The commit skips the spec check only for the very tensor checked at staging, at the same
    memory with the same shape and dtype: new memory is written, a new shape refused."""
    old, new = _states(4)
    segs = encode_delta(old, new, base="p", segment_bytes=4096)
    state = _clone(old)
    upd = stage_delta(state, segs, base="p")
    t = state["a.weight"]
    t.data = old["a.weight"].clone()  # type: ignore[attr-defined]  # same object, new memory
    upd.commit()
    assert state_digest(state) == state_digest(new)
    t.data = torch.zeros(5, dtype=torch.bfloat16)  # type: ignore[attr-defined]  # same object, another shape
    with pytest.raises(TensorMismatch, match=r"a\.weight"):
        upd.rollback()
    assert state_digest({k: v for k, v in state.items() if k != "a.weight"}) == state_digest(
        {k: v for k, v in new.items() if k != "a.weight"}
    )
