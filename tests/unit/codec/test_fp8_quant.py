"""Block-FP8 quantization: the specified bits on every run, dtype path and host; golden bytes."""

from __future__ import annotations

import pytest

from deltarl.codec.fp8 import (
    dequantize_weight,
    e4m3_from_f32_bits,
    quantize_state,
    quantize_weight,
    quantizes,
)
from deltarl.errors import NonFiniteTensor, TensorMismatch

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


def _u8(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _weight() -> torch.Tensor:
    return (((torch.arange(6 * 5, dtype=torch.float32) - 13) * 0.0371) ** 3).reshape(6, 5).bfloat16()


def test_golden_bytes_of_a_small_weight() -> None:
    codes, scale = quantize_weight("w", _weight())
    assert codes.dtype == torch.float8_e4m3fn
    assert scale.dtype == torch.float32
    assert tuple(scale.shape) == (1, 1)
    assert _u8(codes).hex() == "f7f4f1eeeae6e1dcd6cec4b69e001e36444e565c61666a6e717477797c7e"
    assert scale.view(torch.int32).numpy().tobytes().hex() == "4992f439"  # fp32(bf16 amax / 448), LE


def test_integer_rounding_is_torch_nearest_even_cast() -> None:
    """The integer procedure gives what an RNE float8 cast gives: every BF16 value in range, random
    float32 values over E4M3's exponents, and every exact tie between two E4M3 values."""
    every = (torch.arange(65536, dtype=torch.int32) << 16).view(torch.float32)
    g = torch.Generator().manual_seed(7)
    rand = (torch.rand(200_000, generator=g) * 2 - 1) * torch.exp2(torch.randint(-14, 9, (200_000,), generator=g).float())
    grid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = (grid[:-1] + grid[1:]) / 2
    for y in (every, rand, ties, -ties, torch.tensor([0.0, -0.0, 1e-40, -1e-40, 2.0**-10, 448.0])):
        y = y[torch.isfinite(y) & (y.abs() <= 448)].contiguous()
        assert torch.equal(e4m3_from_f32_bits(y.view(torch.int32)), y.to(torch.float8_e4m3fn).view(torch.uint8))


def test_saturates_and_keeps_the_sign_of_zero() -> None:
    y = torch.tensor([460.0, 1000.0, -1e9, -0.0, -1e-30], dtype=torch.float32)
    assert e4m3_from_f32_bits(y.view(torch.int32)).tolist() == [0x7E, 0x7E, 0xFE, 0x80, 0x80]


def test_same_bits_twice_and_across_dtype_paths() -> None:
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(300, 260, generator=g) * 0.02).bfloat16()  # partial edge blocks both ways
    c1, s1 = quantize_weight("w", w)
    c2, s2 = quantize_weight("w", w.clone())
    c3, s3 = quantize_weight("w", w.float())  # the same values as float32
    c4, s4 = quantize_weight("w", w.float().t().contiguous().t())  # a strided view of them
    for c, s in ((c2, s2), (c3, s3), (c4, s4)):
        assert _u8(c) == _u8(c1)
        assert torch.equal(s.view(torch.int32), s1.view(torch.int32))
    assert tuple(s1.shape) == (3, 3)
    assert bool(((c1.view(torch.uint8) & 0x7F) != 0x7F).all())  # never the NaN code


def test_dequantized_error_is_within_half_an_e4m3_step() -> None:
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(256, 384, generator=g) * 0.02).bfloat16()
    codes, scale = quantize_weight("w", w)
    back = dequantize_weight(codes, scale)
    blocks = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    rel = (back - w.float()).abs() / blocks  # in code units
    ulp = torch.clamp(torch.exp2(torch.floor(torch.log2((w.float() / blocks).abs().clamp(min=2**-6)))) / 8, min=2**-9)
    assert bool((rel <= ulp / 2 + 1e-6).all())
    assert int((codes.view(torch.uint8) & 0x7F).max()) == 0x7E  # each block's amax maps to 448


def test_which_tensors_are_quantized() -> None:
    yes = ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.experts.7.down_proj.weight",
           "model.layers.0.mlp.gate_proj.weight"]
    no = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
          "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight", "model.norm.weight",
          "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.self_attn.q_proj.bias"]
    assert all(quantizes(n, (256, 256)) for n in yes)
    assert not any(quantizes(n, (256, 256)) for n in no)
    assert not quantizes("model.layers.0.self_attn.q_proj.weight", (256,))


def test_quantize_state_adds_scales_and_keeps_the_rest() -> None:
    norm = torch.ones(8, dtype=torch.bfloat16)
    state = {"a.q_proj.weight": _weight(), "model.norm.weight": norm}
    out = quantize_state(state)
    assert sorted(out) == ["a.q_proj.weight", "a.q_proj.weight_scale_inv", "model.norm.weight"]
    assert out["model.norm.weight"] is norm
    with pytest.raises(TensorMismatch, match="already"):
        quantize_state(out | {"a.q_proj.weight": _weight()})


def test_nonfinite_weights_are_refused() -> None:
    w = _weight()
    w[1, 2] = float("nan")
    with pytest.raises(NonFiniteTensor, match="w"):
        quantize_weight("w", w)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gives_the_cpu_bits() -> None:
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(1000, 700, generator=g) * torch.exp2(torch.randint(-12, 2, (1000, 1), generator=g).float())).bfloat16()
    c_cpu, s_cpu = quantize_weight("w", w)
    c_gpu, s_gpu = quantize_weight("w", w.cuda())
    assert torch.equal(c_gpu.cpu().view(torch.uint8), c_cpu.view(torch.uint8))
    assert torch.equal(s_gpu.cpu().view(torch.int32), s_cpu.view(torch.int32))
