"""Deterministic block-FP8 quantization: a BF16 state as the FP8 checkpoint an FP8 engine serves.

The layout is vLLM's ``quantization="fp8"`` with ``weight_block_size [128, 128]`` (the DeepSeek and
Qwen3-FP8 checkpoints): each quantized 2-D ``<name>.weight`` becomes a ``float8_e4m3fn`` tensor of
the same shape plus ``<name>.weight_scale_inv``, float32 of shape ``[ceil(R/128), ceil(C/128)]``,
and a weight is ``code * scale`` of its block. The rule (docs/FORMAT.md, "FP8 serving state") is
specified to the bit so that every host and device gives the same codes and scales:

* ``amax`` of a block: the largest ``|x|`` over its elements (partial blocks at the edges: their
  real elements), exact in float32;
* ``scale = fp32(max(amax, 1e-4) / 448)``: one IEEE float32 division, round to nearest even;
* ``code = e4m3(fp32(x / scale))``: one IEEE float32 division, then round to nearest even onto
  E4M3 (bias 7, subnormals ``m * 2^-9``, no infinities) as the integer procedure of
  :func:`e4m3_from_f32_bits` specifies, saturating at ±448 (never the NaN code); the sign is kept,
  so ``-0.0`` and small negatives give ``0x80``.

IEEE division is correctly rounded on every host torch runs on (x86/ARM SIMD, CUDA without fast
math), so the bits do not depend on the device or the thread count. The rounding is done by
torch's float8 cast, checked once per device type against the integer procedure where roundings
can differ (:func:`check_e4m3_cast`). Inputs must be finite (NonFiniteTensor otherwise).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

from deltarl.errors import DeltaRLError, NonFiniteTensor, TensorMismatch

#: The one serving format so far: block-scaled E4M3 with 128x128 blocks.
SERVE_FP8_BLOCK128 = "fp8-block128"
BLOCK = 128
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4  # as float32: an all-zero block gets this amax (scale ~2.2e-7, every code 0)
SCALE_SUFFIX = "_scale_inv"
SLICE_ELEMENTS = 1 << 20  # elements quantized at a time (whole block rows): float32 working copies of ~4 MiB
#: The ``quantization_config`` of a checkpoint in this layout (config.json), as vLLM reads it.
QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}

# Kept in BF16, as vLLM's FP8 checkpoints keep them: embeddings, the output head, norms, and an MoE
# layer's router (``mlp.gate``, ``shared_expert_gate``); anything that is not a 2-D ``.weight``.
_KEEP = re.compile(r"(^|\.)(embed_tokens|lm_head|mlp\.gate|shared_expert_gate|[a-z_]*norm)\.weight$")
_F32_448 = 0x43E00000  # float32 bits of 448.0
_F32_MIN_NORMAL_E4M3 = 121 << 23  # float32 bits of 2^-6, E4M3's smallest normal


def quantizes(name: str, shape: tuple[int, ...]) -> bool:
    """Whether tensor ``name`` of ``shape`` is served as FP8 (else it stays as published)."""
    return len(shape) == 2 and name.endswith(".weight") and _KEEP.search(name) is None and min(shape) > 0


def e4m3_from_f32_bits(bits: Any) -> Any:
    """E4M3 codes (uint8 torch tensor) of float32 bit patterns (int32 torch tensor, any device):
    round to nearest even, saturating at ±448; NaN inputs are not allowed (the caller checks)."""
    import torch

    sign = ((bits >> 31) & 1).to(torch.uint8) << 7
    a = (bits & 0x7FFFFFFF).clamp(max=_F32_448)  # |y| >= 448 saturates to 448 (0x7E)
    # normal range (|y| >= 2^-6): drop 20 mantissa bits rounding to nearest even; the carry runs
    # into the exponent, so the float32 fields rebased to bias 7 are the E4M3 code
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal range: m = RNE(|y| * 2^9) from the 24-bit significand S: |y| * 2^9 = S * 2^(e - 141)
    e = a >> 23
    sig = (a & 0x7FFFFF) | 0x800000
    shift = (141 - e).clamp(min=1, max=31)
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    m = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(q.dtype)
    m = torch.where(e == 0, torch.zeros_like(m), m)  # float32 zero or subnormal: below 2^-126
    code = torch.where(a >= _F32_MIN_NORMAL_E4M3, normal, m).clamp(max=0x7E)
    return code.to(torch.uint8) | sign


def block_amax(x: Any, row0: int = 0) -> Any:
    """The float32 ``[ceil(R/128), ceil(C/128)]`` block maxima of ``|x|`` (a 2-D bfloat16, float16 or
    float32 tensor: the maximum is exact in any of them, and a narrow input reads half the bytes).

    ``row0``: ``x`` holds rows ``row0 ..`` of a larger weight (a row shard); the result then holds
    this shard's share of that weight's block rows ``row0 // 128 .. ceil((row0 + R) / 128)``, whose
    maximum with the other shards' shares is the whole weight's block maxima (zeros stand for the
    rows a shard lacks, which never raise a maximum of absolute values)."""
    import torch

    rows, cols = x.shape
    top = row0 % BLOCK
    pr, pc = -(top + rows) % BLOCK, -cols % BLOCK
    a = x.abs()
    if top or pr or pc:  # zero padding never raises a maximum of absolute values
        a = torch.nn.functional.pad(a, (0, pc, top, pr))
    return a.reshape((top + rows + pr) // BLOCK, BLOCK, (cols + pc) // BLOCK, BLOCK).amax(dim=(1, 3)).to(torch.float32)


def block_scales(name: str, amax: Any) -> Any:
    """The float32 ``weight_scale_inv`` of block maxima ``amax`` (:func:`block_amax`):
    ``fp32(max(amax, 1e-4) / 448)``; NonFiniteTensor if a maximum is NaN or Inf."""
    import torch

    if not bool(torch.isfinite(amax).all()):  # a block's amax is NaN or Inf iff one of its elements is
        raise NonFiniteTensor(f"tensor {name!r} holds NaN or Inf: it has no FP8 quantization")
    amax = torch.maximum(amax, torch.tensor(AMAX_FLOOR, dtype=torch.float32, device=amax.device))
    # divide by a device tensor, never a Python number: torch's CUDA kernel turns division by a CPU
    # scalar into multiplication by its reciprocal, which is not the specified IEEE division
    return (amax / torch.full_like(amax, E4M3_MAX)).contiguous()


def quantize_rows(w: Any, scale: Any, row0: int = 0) -> Any:
    """``float8_e4m3fn`` codes of ``w``, rows ``row0 ..`` of a weight whose block scales (all of
    them, :func:`block_scales`) are ``scale``: the codes those rows have in the whole weight's
    :func:`quantize_weight`, bit for bit, on ``w``'s device. Quantized in slices of whole block
    rows (~:data:`SLICE_ELEMENTS` elements) into the codes tensor, so the float32 working copies
    stay small and short-lived whatever the weight's size."""
    import torch

    rows, cols = w.shape
    out = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=w.device)
    step = max(1, SLICE_ELEMENTS // (BLOCK * max(cols, 1))) * BLOCK
    r = 0
    while r < rows:
        end = min(rows, (row0 + r) // BLOCK * BLOCK + step - row0)  # slices end on the weight's block rows
        out[r:end] = _codes(w[r:end], scale, row0 + r)
        r = end
    check_e4m3_cast(out.device)
    return out


def _codes(w: Any, scale: Any, row0: int) -> Any:
    """The codes of rows ``row0 ..`` of a weight (``w``, within as few block rows as it spans)."""
    import torch

    rows, cols = w.shape
    top = row0 % BLOCK
    b0 = row0 // BLOCK
    pr, pc = -(top + rows) % BLOCK, -cols % BLOCK
    nb = (top + rows + pr) // BLOCK
    x = w.detach().to(torch.float32)
    if top or pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, top, pr))
    part = scale[b0 : b0 + nb].to(x.device)
    y = x.view(nb, BLOCK, part.shape[1], BLOCK) / part[:, None, :, None]
    y = y.clamp_(-E4M3_MAX, E4M3_MAX).view(top + rows + pr, cols + pc)[top : top + rows, :cols]  # |y| <= 448(1 + 2^-23)
    return y.to(torch.float8_e4m3fn)


def quantize_weight(name: str, w: Any) -> tuple[Any, Any]:
    """``(codes, scale_inv)`` of one 2-D weight (bfloat16, float16 or float32 torch tensor, any
    device): ``float8_e4m3fn`` codes of ``w``'s shape and float32 block scales, on ``w``'s device."""
    if w.ndim != 2:
        raise TensorMismatch(f"tensor {name!r}: FP8 block quantization needs a 2-D weight, got {list(w.shape)}")
    scale = block_scales(name, block_amax(w.detach()))
    return quantize_rows(w, scale), scale


def check_e4m3_cast(device: Any) -> None:
    """Check once per device that torch's float32 -> float8_e4m3fn cast is the specified
    rounding (:func:`e4m3_from_f32_bits`) on the values where roundings differ: every tie between
    two E4M3 values, the subnormal range, +-0, the saturation bound. The codes are then cast by
    torch (~100x faster than the integer procedure); a torch that rounds otherwise is refused."""
    _check_cast(device.type, device.index)


@functools.cache
def _check_cast(device_type: str, index: int | None) -> None:
    import torch

    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    grid = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (grid[:-1] + grid[1:]) / 2
    probe = torch.cat([grid, mid, torch.nextafter(mid, grid[1:]), torch.nextafter(mid, grid[:-1]),
                       torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11, 1e-40, 448.0])])  # fmt: skip
    probe = torch.cat([probe, -probe]).to(device)
    want = e4m3_from_f32_bits(probe.view(torch.int32))
    if not torch.equal(probe.to(torch.float8_e4m3fn).view(torch.uint8), want):
        raise DeltaRLError(f"torch {torch.__version__} casts float32 to float8_e4m3fn on {device.type} with another "
                           "rounding than round-to-nearest-even: FP8 serving would not give the specified bits")  # fmt: skip


def quantize_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The FP8 serving state of a torch state: every :func:`quantizes` weight as its codes plus
    ``<name>_scale_inv``, every other tensor as it is (the same object, not copied)."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        if quantizes(name, tuple(value.shape)):
            scale_name = name + SCALE_SUFFIX
            if scale_name in state:
                raise TensorMismatch(f"tensor {scale_name!r} is already in the state: is it quantized already?")
            out[name], out[scale_name] = quantize_weight(name, value)
        else:
            out[name] = value
    return out


def dequantize_weight(codes: Any, scale_inv: Any) -> Any:
    """float32 ``code * scale`` of each element (what the engine's FP8 GEMM multiplies by)."""
    import torch

    rows, cols = codes.shape
    per_elem = scale_inv.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return codes.to(torch.float32) * per_elem


__all__ = [
    "QUANTIZATION_CONFIG",
    "SERVE_FP8_BLOCK128",
    "block_amax",
    "block_scales",
    "dequantize_weight",
    "e4m3_from_f32_bits",
    "quantize_rows",
    "quantize_state",
    "quantize_weight",
    "quantizes",
]
