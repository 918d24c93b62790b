"""MoE and tensor/expert parallel layouts in vLLM's real engine (CPU build): after N updates every
layout serves the trainer's state bit for bit and generates exactly as a fresh engine of the same
layout on ``replay(N)``; a corrupt piece is refused on every rank with the served weights
bit-identical everywhere; a late engine bootstraps, each rank reading its part.

The checkpoints hold their experts fused, as transformers writes Qwen3-MoE (``gate_up_proj``
``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``): at TP 2 each rank holds a column range of a fold of
them, with expert parallel a row range (its experts).

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

from tests.integration.vllm.conftest import engine, greedy, publish_corrupt, shut

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
    generates: bool  # False: vLLM's CPU build cannot generate with this layout (NO_GENERATE)


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


#: Layouts whose engine cannot generate on vLLM's CPU build; their updates, digests, refusals and
#: bootstrap are checked all the same. Expert parallel: ``CPUUnquantizedExperts.apply``
#: (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py) hands ``cpu_fused_moe`` the router's
#: global ``topk_ids`` and never its ``expert_map``, while ``w13``/``w2`` hold only the rank's experts:
#: a plain vLLM 0.32 engine (no deltarl) with ``enable_expert_parallel=True`` segfaults in
#: ``csrc/cpu/cpu_fused_moe.cpp:242`` (``fused_moe_impl``) on its first generate.
NO_GENERATE = {"moe-ep2": "vLLM 0.32's CPU experts kernel ignores expert_map (segfaults on generate)"}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Layout]:
    arch, options = LAYOUTS[request.param]
    if options.get("tensor_parallel_size", 1) > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core a rank
    root = tmp_path_factory.mktemp(request.param)
    ckpt, states = _publish(root, arch)
    yield Layout(root, ckpt, str(root / "store"), states, options, request.param not in NO_GENERATE)
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
    after = greedy(served) if layout.generates else None
    fresh = engine(_fresh_dir(layout, N), **layout.options)  # vLLM's own loader on replay(N)
    try:
        if layout.generates:
            assert greedy(fresh) == after  # tokens and logprobs, exactly
        boot = attach(fresh, layout.store, "r")  # late: from the keyframe, each rank reading its part
        assert boot["version"] == N
        assert status(fresh, digest=True)[0]["engine_digest"] == ranks[0]["engine_digest"]
        if layout.generates:
            assert greedy(fresh) == after
    finally:
        shut(fresh)


def test_a_corrupt_piece_is_refused_on_every_rank_and_nothing_changes(layout: Layout, served: Any) -> None:
    from deltarl.integrations.vllm import status, update
    from deltarl.testing.vllm_runs import evolve

    before = status(served, digest=True)
    tokens = greedy(served) if layout.generates else None
    v = before[0]["version"]
    publish_corrupt(layout.store, "r", evolve(layout.states[v], 0.01, seed=500 + v), v + 1, keyframe_interval=1000)
    with pytest.raises(Exception, match=r"no source delivered bytes matching its manifest|IntegrityError|hash"):
        update(served, v + 1)
    after = status(served, digest=True)
    assert [(r["version"], r["digest"]) for r in after] == [(r["version"], r["digest"]) for r in before]  # every rank
    if layout.generates:
        assert greedy(served) == tokens
