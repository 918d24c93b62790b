"""Fixtures for the tests against vLLM's real engine (CPU build, ``.venv-vllm``; skipped without vLLM).

One checkpoint, one run and as few engines as the checks allow per module: an engine costs ~15 s
to start on two cores.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:  # the main .venv: nothing here is collected
    collect_ignore_glob = ["test_*.py"]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default wants a share of the host

#: tiny Qwen3 with head_dim 64 (vLLM's CPU attention has no kernel below 32)
SPEC = {"hidden_size": 256, "intermediate_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
        "seed": 3, "init_std": 0.2}
VERSIONS = 4  # published before the tests: 0 (keyframe) .. 4, keyframe at 3
PROMPTS = [[72, 101, 108, 108, 111], [49, 43, 49, 61], [257, 65, 66, 67, 68, 69, 70]]


@dataclass
class Run:
    root: Path
    ckpt: Path
    store_url: str
    run: str
    states: list[dict[str, Any]]

    def checkpoint_of(self, version: int) -> Path:
        """A checkpoint directory holding the replayed state of ``version`` (config and tokenizer of ``ckpt``)."""
        from safetensors.torch import save_file

        from deltarl.pipeline.replay import replay
        from deltarl.storage.open import open_store

        out = self.root / f"replay-{version}"
        if not out.exists():
            shutil.copytree(self.ckpt, out, ignore=shutil.ignore_patterns("*.safetensors"))
            store = open_store(self.store_url, must_exist=True)
            try:
                save_file(replay(store, self.run, version), str(out / "model.safetensors"), metadata={"format": "pt"})
            finally:
                store.close()
        return out


def engine(model: Path, **kwargs: Any) -> Any:
    """A ``vllm.LLM`` on ``model`` with the deltarl backend, small and deterministic."""
    from vllm import LLM

    from deltarl.integrations.vllm import ENGINE_KWARGS

    return LLM(model=str(model), dtype="bfloat16", enforce_eager=True, max_model_len=128, seed=0,
               gpu_memory_utilization=0.05, max_num_seqs=8, **ENGINE_KWARGS, **kwargs)


def greedy(llm: Any) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for :data:`PROMPTS`."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [([int(t) for t in c.token_ids], [float(c.logprobs[i][t].logprob) for i, t in enumerate(c.token_ids)])
            for o in outs for c in o.outputs]


def shut(llm: Any) -> None:
    """Stop the engine (see :func:`deltarl.testing.vllm_runs.shut_engine`)."""
    from deltarl.testing.vllm_runs import shut_engine

    shut_engine(llm)


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The checkpoint, and a run of :data:`VERSIONS` versions (~1% of elements changed each) in a local store."""
    from deltarl.integrations.vllm.plugin import request_amx

    request_amx()  # before vLLM starts anything in this process (see deltarl.integrations.vllm.plugin)
    from deltarl.model.build import ModelSpec
    from deltarl.pipeline.publisher import Publisher
    from deltarl.storage.open import open_store
    from deltarl.testing.vllm_runs import evolve, write_checkpoint

    root = tmp_path_factory.mktemp("vllm")
    states = [write_checkpoint(root / "ckpt", ModelSpec(**SPEC))]
    store = open_store(str(root / "store"))
    with Publisher(store, "r", keyframe_interval=3, digest_interval=2) as pub:
        pub.publish(states[0], 0)
        for v in range(1, VERSIONS + 1):
            states.append(evolve(states[-1], 0.01, seed=v))
            pub.publish(states[-1], v)
    store.close()
    return Run(root, root / "ckpt", str(root / "store"), "r", states)


@pytest.fixture(scope="module")
def served(vllm_run: Run) -> Iterator[Any]:
    """An engine attached to the run at version 0 (its weights loaded from the store)."""
    from deltarl.integrations.vllm import attach

    llm = engine(vllm_run.ckpt)
    attach(llm, vllm_run.store_url, vllm_run.run, version=0)
    yield llm
    shut(llm)



#: The longest test files (seconds alone on two cores), started first: ``make test`` runs this suite
#: beside the main suite, and a long file started last would run alone on one worker at the end.
LONGEST_FIRST = ("test_parallel", "test_serve_sync", "test_architectures", "test_engine", "test_engine_faults")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put :data:`LONGEST_FIRST`'s files ahead of the rest, each file's tests in their own order."""

    def rank(item: pytest.Item) -> int:
        name = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file is kept


def publish_corrupt(store_dir: str | Path, run: str, state: dict[str, Any], version: int, **publisher: Any) -> Path:
    """Publish ``state`` as ``version`` of ``run`` with one bit of its last segment flipped, so that an
    engine following the run never sees the version whole: it is published into a copy of the store,
    the bit flipped there, and its files moved in segments first, then its manifest, then HEAD (each
    replaced whole). An engine staging in the background would otherwise stage the version before the
    bit flips, and the refusal the test expects never comes (a loaded box, make test, 2026-12-07).
    Returns the corrupt segment's path in the store."""
    from deltarl.pipeline.publisher import Publisher
    from deltarl.storage.open import open_store

    store_dir = Path(store_dir)
    scratch = store_dir.with_name(f"{store_dir.name}-corrupt-{version}")
    shutil.copytree(store_dir, scratch)
    store = open_store(str(scratch))
    with Publisher(store, run, **publisher) as pub:
        pub.publish(state, version)
    store.close()
    name = f"{version:012d}"
    src, dst = scratch / run / "versions" / name, store_dir / run / "versions" / name
    seg = sorted(src.glob("*-seg-*.bin"))[-1]  # the last: the tensors sorted last (one rank's part of them at TP 2)
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the middle of the segment
    seg.chmod(0o644)
    seg.write_bytes(bytes(data))
    dst.mkdir()
    for f in [*sorted(src.glob("*-seg-*.bin")), src / "manifest.json", scratch / run / "HEAD"]:
        target = (store_dir / run / "HEAD") if f.name == "HEAD" else dst / f.name
        tmp = target.with_name(target.name + ".tmp")
        shutil.copyfile(f, tmp)
        os.replace(tmp, target)
    return dst / seg.name
