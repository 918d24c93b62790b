"""gather_bf16 on a plain model and on a PEFT LoRA model: the export actors would serve, training weights untouched."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from deltarl.errors import IntegrationError  # noqa: E402
from deltarl.integrations.gather import clean_name, gather_bf16  # noqa: E402
from deltarl.model.build import ModelSpec, build_model, export_bf16  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    # transformers 5.24 renamed gradient checkpointing; peft still asks by the old name
    pytest.mark.filterwarnings("ignore:`(is_)?gradient_checkpointing.*` is deprecated:FutureWarning"),
]


def _bits_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert (a[name].dtype, a[name].is_contiguous()) == (torch.bfloat16, True), name
        assert torch.equal(a[name].view(torch.int16), b[name].view(torch.int16)), name


def test_plain_model_equals_export_bf16() -> None:
    model = build_model(ModelSpec())
    _bits_equal(gather_bf16(model, is_main=True), export_bf16(model))
    assert gather_bf16(model, is_main=False) == {}


def test_wrapper_segments_are_dropped() -> None:
    assert clean_name("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.w") == (
        "model.layers.0.mlp.w")  # fmt: skip
    assert clean_name("_orig_mod.lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peft_lora_is_merged_as_merge_and_unload_merges(dtype: str) -> None:
    peft = pytest.importorskip("peft")
    model = build_model(ModelSpec(), dtype=getattr(torch, dtype))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)  # B != 0: the merge changes the weights
    lora = peft.get_peft_model(model, config)
    before = {n: p.detach().clone() for n, p in lora.named_parameters()}
    want = export_bf16(copy.deepcopy(lora).merge_and_unload())
    got = gather_bf16(lora, is_main=True)
    _bits_equal(got, want)
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           export_bf16(build_model(ModelSpec()))["model.layers.0.self_attn.q_proj.weight"])
    for n, p in lora.named_parameters():  # nothing merged into the training weights or adapters
        assert torch.equal(p, before[n]), n
    assert not any(getattr(m, "merged", False) for m in lora.modules())


def test_dora_is_refused_with_a_clear_error() -> None:
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(build_model(ModelSpec()), peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(IntegrationError, match="DoRA"):
        gather_bf16(lora, is_main=True)
