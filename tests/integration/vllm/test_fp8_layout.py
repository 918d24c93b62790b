"""A ``save_fp8_checkpoint`` folder goes through vLLM's own ``quantization="fp8"`` weight creation and
the model's ``load_weights``: the fused ``qkv_proj`` / ``gate_up_proj`` parameters hold our codes and
block scales. vLLM creates FP8 block-quantized layers only where its FP8 kernel exists (CUDA, or a
CPU with AMX tiles); elsewhere (AMD EPYC, the project's CI boxes) this test skips saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _has_fp8_kernel() -> bool:
    if torch.cuda.is_available():
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_tile" in flags


@pytest.mark.skipif(not _has_fp8_kernel(), reason="needs AMX / CUDA: vLLM has no FP8 block kernel on this CPU")
def test_fp8_checkpoint_loads_through_vllm_load_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader.utils import initialize_model

    from deltarl.codec.fp8 import quantize_state
    from deltarl.model.build import ModelSpec
    from deltarl.pipeline.fp8_checkpoint import save_fp8_checkpoint
    from deltarl.testing.vllm_runs import write_checkpoint

    spec = ModelSpec(hidden_size=256, intermediate_size=384, num_layers=1, num_heads=4, num_kv_heads=2, seed=3)
    fp8 = quantize_state(write_checkpoint(tmp_path / "bf16", spec))
    out = save_fp8_checkpoint(fp8, tmp_path / "fp8", json.loads((tmp_path / "bf16" / "config.json").read_text()))
    mc = ModelConfig(model=str(out), quantization="fp8", dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True)
    vc = VllmConfig(model_config=mc, load_config=LoadConfig())
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{tmp_path}/dist", backend="gloo")  # fmt: skip
        ensure_model_parallel_initialized(1, 1)
        model = initialize_model(vllm_config=vc)
        model.load_weights(load_file(out / "model.safetensors").items())
    params = {n: p.data.cpu() for n, p in model.named_parameters()}
    p = "model.layers.0."
    fused = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"]}  # fmt: skip
    for into, parts in fused.items():
        codes = torch.cat([fp8[f"{p}{x}.weight"].view(torch.uint8) for x in parts])
        scales = torch.cat([fp8[f"{p}{x}.weight_scale_inv"] for x in parts])
        assert params[f"{p}{into}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(params[f"{p}{into}.weight"].view(torch.uint8), codes)
        assert torch.equal(params[f"{p}{into}.weight_scale_inv"], scales)
