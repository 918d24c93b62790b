"""MoE and tensor/expert parallel layouts in vLLM's real engine (CPU build): after N updates every
layout generates exactly as a fresh engine of the same layout on ``replay(N)``; a corrupt piece is
refused on every rank with the served weights bit-identical everywhere; a late engine bootstraps.

One engine per layout serves all of its checks (an engine costs ~15-30 s to start on two cores).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.vllm.conftest import engine, greedy, shut

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.filterwarnings("ignore")]  # vLLM's own warnings

COMMON = {"vocab_size": 259, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 256, "initializer_range": 0.2}
MOE = {"moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False}
N = 2  # versions after the keyframe at 0

#: layout -> (architecture, vLLM options)
LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "moe-tp1": ("moe", {}),
    "dense-tp2": ("dense", {"tensor_parallel_size": 2}),
    "moe-tp2": ("moe", {"tensor_parallel_size": 2}),
    "moe-ep2": ("moe", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
}


@dataclass
class Layout:
    root: Path
    ckpt: Path
    store: str
    states: list[dict[str, Any]]
    options: dict[str, Any]


def _publish(root: Path, arch: str) -> tuple[Path, list[dict[str, Any]]]:
    from transformers import Qwen3Config, Qwen3MoeConfig

    from deltarl.integrations.vllm.plugin import request_amx
    from deltarl.model.build import ModelSpec
    from deltarl.pipeline.publisher import Publisher
    from deltarl.storage.open import open_store
    from deltarl.testing.vllm_runs import evolve, write_checkpoint

    request_amx()
    config = Qwen3MoeConfig(**COMMON, **MOE) if arch == "moe" else Qwen3Config(**COMMON, tie_word_embeddings=False)
    states = [write_checkpoint(root / "ckpt", ModelSpec(seed=7), config=config)]
    store = open_store(str(root / "store"))
    with Publisher(store, "r", keyframe_interval=1000, digest_interval=1) as pub:  # auto: cells a rank decodes alone
        pub.publish(states[0], 0)
        for v in range(1, N + 1):
            states.append(evolve(states[-1], 0.01, seed=v))
            pub.publish(states[-1], v)
    store.close()
    return root / "ckpt", states


#: MoE at TP 2 and with expert parallel do not pass yet (issue 32 stays open): the tiny Qwen3-MoE
#: checkpoint transformers writes holds its experts fused and transposed, and vLLM narrows w2 along
#: that transposed dimension at TP 2, which the probe refuses at init (TensorMismatch, "transposed
#: or repacked"); with expert parallel the engine dies after init (cause not found yet). Skipped,
#: not xfailed: an engine that dies leaves vLLM's zmq contexts behind, which the suite's
#: warnings-as-errors turns into a failure of the whole session.
KNOWN_FAILING = {
    "moe-tp2": pytest.mark.skip(reason="issue 32: a TP 2 rank's w2 of fused transposed experts is refused at init"),
    "moe-ep2": pytest.mark.skip(reason="issue 32: the expert-parallel engine dies after init"),
}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=KNOWN_FAILING.get(name, ())) for name in LAYOUTS])
def layout(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Layout]:
    arch, options = LAYOUTS[request.param]
    if options.get("tensor_parallel_size", 1) > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core a rank
    root = tmp_path_factory.mktemp(request.param)
    ckpt, states = _publish(root, arch)
    yield Layout(root, ckpt, str(root / "store"), states, options)
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


@pytest.fixture(scope="module")
def served(layout: Layout) -> Iterator[Any]:
    from deltarl.integrations.vllm import attach

    llm = engine(layout.ckpt, **layout.options)
    attach(llm, layout.store, "r", version=0)
    yield llm
    shut(llm)


def _digest(state: dict[str, Any]) -> str:
    from deltarl.codec import state_digest

    return state_digest(state)


def _fresh_dir(layout: Layout, version: int) -> Path:
    from safetensors.torch import save_file

    out = layout.root / f"fresh-{version}"
    if not out.exists():
        shutil.copytree(layout.ckpt, out, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(layout.states[version], str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_updates_equal_a_fresh_engine_of_the_same_layout(layout: Layout, served: Any) -> None:
    from deltarl.integrations.vllm import attach, status, update

    for v in range(1, N + 1):
        assert update(served, v)["version"] == v
    ranks = status(served, digest=True)
    assert {r["version"] for r in ranks} == {N}
    assert ranks[0]["engine_digest"] == _digest(layout.states[N])  # the whole engine, bit for bit the trainer's
    after = greedy(served)
    fresh = engine(_fresh_dir(layout, N), **layout.options)  # vLLM's own loader on replay(N)
    try:
        assert greedy(fresh) == after  # tokens and logprobs, exactly
        boot = attach(fresh, layout.store, "r")  # late: from the keyframe, each rank reading its part
        assert boot["version"] == N
        assert status(fresh, digest=True)[0]["engine_digest"] == ranks[0]["engine_digest"]
        assert greedy(fresh) == after
    finally:
        shut(fresh)


def test_a_corrupt_piece_is_refused_on_every_rank_and_nothing_changes(layout: Layout, served: Any) -> None:
    from deltarl.integrations.vllm import status, update
    from deltarl.pipeline.publisher import Publisher
    from deltarl.storage.open import open_store
    from deltarl.testing.vllm_runs import evolve

    before = status(served, digest=True)
    tokens = greedy(served)
    v = before[0]["version"]
    store = open_store(layout.store)
    with Publisher(store, "r", keyframe_interval=1000) as pub:
        pub.publish(evolve(layout.states[v], 0.01, seed=500 + v), v + 1)
    store.close()
    segs = sorted((Path(layout.store) / "r" / "versions" / f"{v + 1:012d}").glob("*-seg-*.bin"))
    seg = segs[-1]  # the last segment: the tensors sorted last (one rank's part of them, at TP 2)
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x01
    seg.chmod(0o644)
    seg.write_bytes(bytes(data))
    with pytest.raises(Exception, match=r"no source delivered bytes matching its manifest|IntegrityError|hash"):
        update(served, v + 1)
    after = status(served, digest=True)
    assert [(r["version"], r["digest"]) for r in after] == [(r["version"], r["digest"]) for r in before]  # every rank
    assert greedy(served) == tokens
