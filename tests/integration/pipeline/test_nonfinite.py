"""A state holding NaN or Inf is never published unless the caller opts in."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from deltarl.codec.finite import check_finite
from deltarl.errors import DeltaRLError, NonFiniteTensor
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.replay import replay
from deltarl.storage import MemoryStore
from tests.fixtures.runs import TinyTrainer, states_equal


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["layers.0.attn.weight", "layers.0.norm.bias", "lm_head.weight"])
def test_publish_refuses_non_finite_tensors(memory_store: MemoryStore, poison: float, name: str) -> None:
    trainer = TinyTrainer(0)
    with Publisher(memory_store, "r") as pub:
        first = trainer.export()
        pub.publish(first, step=0)
        trainer.step()
        bad = trainer.export()
        bad[name].view(-1)[7] = poison
        with pytest.raises(NonFiniteTensor, match=name) as err:
            pub.publish(bad, step=1)
        assert isinstance(err.value, DeltaRLError)
        assert RunReader(memory_store, "r").head().version == 0  # nothing was committed
        trainer.step()
        good = trainer.export()
        assert pub.publish(good, step=1).version == 1  # the publisher goes on with a finite state
    assert states_equal(replay(memory_store, "r", 1), good)


def test_allow_nonfinite_publishes_it_bit_exact(memory_store: MemoryStore) -> None:
    state = TinyTrainer(1).export()
    state["embed.weight"].view(-1)[:3] = float("nan")
    with Publisher(memory_store, "r") as pub:
        pub.publish(state, step=0, allow_nonfinite=True)
    assert states_equal(replay(memory_store, "r", 0), state)


@pytest.mark.parametrize("contiguous", [True, False])  # raw-bits path / float32-sum fallback
def test_check_finite_both_paths(contiguous: bool) -> None:
    import torch

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        t = torch.linspace(-60000, 60000, 2997).to(dtype).reshape(999, 3)
        if not contiguous:
            t = t.t()  # a transposed view: not contiguous
        check_finite({"t": t})
        for poison in (float("nan"), float("inf"), float("-inf")):
            bad = t.contiguous().clone()
            bad.view(-1)[500] = poison
            if not contiguous:
                bad = bad.t().contiguous().t()
            assert bad.is_contiguous() == contiguous
            with pytest.raises(NonFiniteTensor, match="'t' holds 1 NaN/Inf values of 2997"):
                check_finite({"ok": t, "t": bad})

    big = torch.full((1000,), 3.0e38, dtype=torch.float32)  # finite, but its sum overflows
    check_finite({"w": big if contiguous else big[::2], "ids": torch.arange(5), "meta": "x"})
    arr = np.zeros(3 << 20, dtype=np.float16)  # several 1M-element chunks, the bad one last
    check_finite({"a": arr})
    arr[-1] = np.inf
    with pytest.raises(NonFiniteTensor, match="'a' holds 1 NaN/Inf"):
        check_finite({"a": arr if contiguous else arr[::-1]})


def test_check_finite_on_threads_names_the_first_bad_tensor_in_order() -> None:
    import torch

    state = {f"w{i}": torch.zeros(1000 * (i + 1), dtype=torch.bfloat16) for i in range(8)}
    state["w6"][3] = float("nan")
    state["w2"][7] = float("inf")  # smaller, checked later on the threads, but first in the mapping
    for threads in (1, 2, 4):
        with pytest.raises(NonFiniteTensor, match="'w2' holds 1 NaN/Inf values of 3000"):
            check_finite(state, threads=threads)
    state["w2"][7] = 0.0
    with pytest.raises(NonFiniteTensor, match="'w6'"):
        check_finite(state, threads=4)


def test_a_refused_delta_leaves_no_segment_and_a_nan_kept_from_an_opted_in_version_is_still_refused(
    memory_store: MemoryStore,
) -> None:
    from deltarl.pipeline.layout import RunLayout

    trainer = TinyTrainer(2)
    with Publisher(memory_store, "r", segment_bytes=4096, segment_changes=64) as pub:
        pub.publish(trainer.export(), step=0)
        trainer.step()
        bad = trainer.export()
        bad["lm_head.weight"].view(-1)[-1] = float("nan")  # changed, late: segments before it were uploaded
        with pytest.raises(NonFiniteTensor, match=r"'lm_head\.weight' holds 1 NaN/Inf values among"):
            pub.publish(bad, step=1)
        assert not list(memory_store.list(RunLayout("r").version_prefix(1)))  # what it uploaded is deleted
        pub.publish(bad, step=1, allow_nonfinite=True)  # the caller opts in for this version
        trainer.step()
        kept = trainer.export()
        kept["lm_head.weight"].view(-1)[-1] = float("nan")  # unchanged from version 1, not a change
        with pytest.raises(NonFiniteTensor, match=r"'lm_head\.weight' holds 1 NaN/Inf values of"):
            pub.publish(kept, step=2)  # the base was not known finite: the whole state is checked
        kept["lm_head.weight"].view(-1)[-1] = 0.5
        assert pub.publish(kept, step=2).version == 2
        trainer.step()
        assert pub.publish(trainer.export(), step=3).version == 3  # finite again: changes-only from here
    assert states_equal(replay(memory_store, "r", 3), trainer.export())


def test_a_resumed_publisher_checks_its_first_version_whole(memory_store: MemoryStore) -> None:
    trainer = TinyTrainer(3)
    poisoned = trainer.export()
    poisoned["embed.weight"].view(-1)[5] = float("inf")
    with Publisher(memory_store, "r") as pub:
        pub.publish(poisoned, step=0, allow_nonfinite=True)
    # a new publisher resumes from the store: its base is not known finite
    with Publisher(memory_store, "r") as pub, pytest.raises(NonFiniteTensor, match=r"'embed\.weight' holds 1 NaN/Inf values of"):
        pub.publish(poisoned, step=1)


def test_a_resumed_publisher_with_a_finite_base_checks_only_what_its_first_version_changes(memory_store: MemoryStore) -> None:
    trainer = TinyTrainer(4)
    with Publisher(memory_store, "r") as pub:
        pub.publish(trainer.export(), step=0)
    trainer.step()
    bad = trainer.export()
    bad["embed.weight"].view(-1)[7] = float("nan")
    # the base was checked whole in the background when the publisher opened: the new NaN is a change
    with Publisher(memory_store, "r") as pub, pytest.raises(NonFiniteTensor, match=r"'embed\.weight' holds 1 NaN/Inf values among"):
        pub.publish(bad, step=1)


@pytest.mark.parametrize("base_finite", [True, False])
def test_a_first_publish_encodes_while_the_resumed_base_is_still_checked(
    memory_store: MemoryStore, monkeypatch: pytest.MonkeyPatch, base_finite: bool
) -> None:
    import deltarl.pipeline.publisher as publisher_module
    from deltarl.pipeline.layout import RunLayout

    trainer = TinyTrainer(6)
    base = trainer.export()
    if not base_finite:
        base["embed.weight"].view(-1)[5] = float("inf")
    with Publisher(memory_store, "r") as pub:
        pub.publish(base, step=0, allow_nonfinite=not base_finite)
    trainer.step()
    nxt = trainer.export()
    if not base_finite:
        nxt["embed.weight"].view(-1)[5] = float("inf")  # kept from the base: not a change
    release = threading.Event()
    real_is_finite = publisher_module.is_finite

    def held_base_check(state: Any, **kw: Any) -> bool:  # the resumed base's check, held until released
        assert release.wait(30)
        return real_is_finite(state, **kw)

    monkeypatch.setattr(publisher_module, "is_finite", held_base_check)
    prefix = RunLayout("r").version_prefix(1)
    with Publisher(memory_store, "r") as pub, ThreadPoolExecutor(1) as caller:
        publishing = caller.submit(pub.publish, nxt, 1)
        deadline = time.monotonic() + 30
        while not any(memory_store.list(prefix)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any(memory_store.list(prefix)), "the delta was not encoded while the base check ran"
        time.sleep(0.2)
        assert not publishing.done()  # nothing commits before the base is known
        assert RunReader(memory_store, "r").head().version == 0
        release.set()
        if base_finite:
            assert publishing.result().version == 1
        else:
            with pytest.raises(NonFiniteTensor, match=r"'embed\.weight' holds 1 NaN/Inf values of"):
                publishing.result()
    if base_finite:
        assert states_equal(replay(memory_store, "r", 1), nxt)
    else:
        assert RunReader(memory_store, "r").head().version == 0
        assert not any(memory_store.list(prefix))  # its segments were discarded


def test_the_encoder_checks_changed_values_only_when_asked() -> None:
    import torch

    from deltarl.codec import iter_encode_delta

    old = {"w": torch.zeros(10_000, dtype=torch.bfloat16)}
    new = {"w": old["w"].clone()}
    new["w"][9_000] = float("-inf")
    assert list(iter_encode_delta(old, new, base="b" * 64))  # the codec itself is lossless for any bits
    with pytest.raises(NonFiniteTensor, match=r"'w' holds 1 NaN/Inf values among the 1 elements changed in \[0, 10000\)"):
        list(iter_encode_delta(old, new, base="b" * 64, check_finite=True))
