"""Backends by name: one table, read by the config, the actor, its command and the demo; no
branch on a backend's name anywhere else."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

from deltarl.actor.backends.table import BACKENDS, backend_entry
from deltarl.actor.config import ActorConfig
from deltarl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def test_the_table_names_each_backend_by_its_key_and_its_adapter_offers_both_calls() -> None:
    pytest.importorskip("torch")
    for name, entry in BACKENDS.items():
        assert entry.name == name
        module = importlib.import_module(entry.adapter)  # the vllm adapter imports vLLM only when building
        assert callable(module.open_weights)
        assert callable(module.build)


def test_an_unknown_backend_is_refused_when_the_config_is_read(tmp_path: Path) -> None:
    path = tmp_path / "actor.json"
    path.write_text(json.dumps({"backend": "sglang-typo"}))
    with pytest.raises(ConfigError, match=r"unknown generation backend 'sglang-typo' \(known: hf, vllm\)"):
        ActorConfig.load(path)


@pytest.mark.parametrize(("key", "most"), [("tensor_parallel_size", 8), ("pipeline_parallel_size", 1)])
def test_a_parallel_layout_the_engine_cannot_serve_is_refused_naming_engine_and_limit(
    tmp_path: Path, key: str, most: int
) -> None:
    path = tmp_path / "actor.yaml"
    path.write_text(f"actor:\n  backend: vllm\n  engine_options:\n    {key}: {most + 1}\n")
    with pytest.raises(ConfigError, match=rf"backend 'vllm' serves {key} up to {most}, got {most + 1}"):
        ActorConfig.load(path)
    with pytest.raises(ConfigError, match=rf"backend 'vllm' serves {key} up to {most}, got {2 * most + 2}"):
        ActorConfig.load(None, backend="vllm", engine_options={key: 2 * most + 2})
    assert ActorConfig.load(path, engine_options={key: most}).engine_options == {key: most}


def test_engine_options_reach_only_an_engine_that_takes_them() -> None:
    cfg = ActorConfig.load(None, backend="vllm", engine_options={"max_model_len": 128, "enforce_eager": True})
    assert cfg.backend_entry() is BACKENDS["vllm"]
    with pytest.raises(ConfigError, match=r"backend 'hf' takes no engine options \(got \['max_model_len'\]\)"):
        ActorConfig.load(None, engine_options={"max_model_len": 128})
    with pytest.raises(ConfigError, match="must be a positive integer"):
        backend_entry("vllm").check_options({"tensor_parallel_size": "2"})


def test_the_old_vllm_only_fields_are_gone() -> None:
    for field in ("vllm_options", "tensor_parallel_size"):
        with pytest.raises(ConfigError, match="Extra inputs"):
            ActorConfig.load(None, **{field: {} if field == "vllm_options" else 1})


def _name_comparisons(path: Path) -> list[str]:
    """``x == "hf"``-style comparisons (and ``in`` tests) against a backend's name in one file."""
    names = set(BACKENDS)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                consts = [operand] if isinstance(operand, ast.Constant) else (
                    list(operand.elts) if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [])
                if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_nothing_branches_on_a_backend_name_outside_its_own_adapter() -> None:
    adapters = {ROOT / (entry.adapter.replace(".", "/") + ".py") for entry in BACKENDS.values()}
    files = [p for p in sorted((ROOT / "deltarl").rglob("*.py")) if p not in adapters]
    assert [hit for p in files for hit in _name_comparisons(p)] == []


def test_engine_kwargs_are_defined_once_and_name_the_integrations_engine() -> None:
    from deltarl.actor.backends import vllm as adapter
    from deltarl.integrations.vllm import ENGINE_KWARGS
    from deltarl.integrations.vllm.plugin import BACKEND
    from deltarl.integrations.vllm.worker import WORKER_EXTENSION

    assert ENGINE_KWARGS is adapter.ENGINE_KWARGS
    assert ENGINE_KWARGS == {"weight_transfer_config": {"backend": BACKEND}, "worker_extension_cls": WORKER_EXTENSION}
    defined = [p for p in (ROOT / "deltarl").rglob("*.py") if "ENGINE_KWARGS: " in p.read_text()]
    assert [p.relative_to(ROOT).as_posix() for p in defined] == ["deltarl/actor/backends/vllm.py"]


def test_the_vllm_backend_offers_no_host_side_weights() -> None:
    pytest.importorskip("torch")
    from deltarl.actor.backends.base import GenerationBackend, HostWeightsBackend
    from deltarl.actor.backends.hf import HFBackend
    from deltarl.actor.backends.vllm import VLLMEngineBackend

    for method in ("state_dict_for_update", "commit", "load_state"):
        assert not hasattr(VLLMEngineBackend, method)
        assert callable(getattr(HFBackend, method))
    for method in ("generate", "served_digest", "close"):
        assert callable(getattr(VLLMEngineBackend, method))
        assert callable(getattr(HFBackend, method))
    assert GenerationBackend in HostWeightsBackend.__mro__
