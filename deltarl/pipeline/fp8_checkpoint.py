"""The FP8 serving state on the pipeline's side: what a publisher publishes with ``serve_as``, and
the checkpoint folder an FP8 engine loads from a replayed version.

A run published with ``serve_as="fp8-block128"`` holds the quantized state itself (its tensor table
names ``<w>.weight`` as ``float8_e4m3fn`` and ``<w>.weight_scale_inv`` as ``float32``), so
``replay(store, run, N)`` returns the FP8 state with no extra step, and
:func:`save_fp8_checkpoint` writes it as the folder vLLM opens with ``quantization="fp8"``:
``model.safetensors`` (:func:`~deltarl.pipeline.state_file.write_state_file`) and ``config.json``
with the ``quantization_config`` block of :data:`deltarl.codec.fp8.QUANTIZATION_CONFIG`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deltarl.codec.fp8 import QUANTIZATION_CONFIG, SCALE_SUFFIX, SERVE_FP8_BLOCK128, quantize_state, quantizes
from deltarl.codec.tensors import dtype_of
from deltarl.errors import TensorMismatch
from deltarl.pipeline.state_file import write_state_file
from deltarl.pipeline.uploads import as_torch, cpu_copy


def serving_state(state: Mapping[str, Any], serve_as: str | None, owned: bool) -> tuple[Mapping[str, Any], bool]:
    """The state a publisher publishes for ``serve_as`` and whether the publisher owns its tensors:
    the state itself for ``None``; for ``"fp8-block128"`` the FP8 serving state (fresh codes and
    scales; the tensors kept as they are copied unless ``owned``), which the publisher then owns."""
    if serve_as is None:
        return state, owned
    if serve_as != SERVE_FP8_BLOCK128:
        raise ValueError(f"unknown serve_as {serve_as!r} (known: {SERVE_FP8_BLOCK128!r})")
    torch_state = {name: as_torch(v) if quantizes(name, tuple(v.shape)) else v for name, v in state.items()}
    out = quantize_state(torch_state)
    if not owned:
        out = {name: cpu_copy(v) if v is state.get(name) else v for name, v in out.items()}
    return out, True


def check_fp8_state(state: Mapping[str, Any]) -> int:
    """Raise TensorMismatch unless every ``float8_e4m3fn`` weight of ``state`` has its float32
    ``weight_scale_inv`` of the block shape; returns the number of quantized weights."""
    n = 0
    for name, value in state.items():
        if dtype_of(name, value) != "float8_e4m3fn":
            continue
        scale = state.get(name + SCALE_SUFFIX)
        rows, cols = (int(d) for d in value.shape)
        want = ((rows + 127) // 128, (cols + 127) // 128)
        if scale is None or dtype_of(name, scale) != "float32" or tuple(int(d) for d in scale.shape) != want:
            raise TensorMismatch(f"FP8 weight {name!r} lacks a float32 {name + SCALE_SUFFIX!r} of shape {list(want)}")
        n += 1
    return n


def save_fp8_checkpoint(
    state: Mapping[str, Any], directory: str | os.PathLike[str], config: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write an FP8 serving state (e.g. ``replay(store, run, N)`` of a ``serve_as="fp8-block128"``
    run) as a checkpoint folder: ``model.safetensors`` and ``config.json``, the model's ``config``
    with ``quantization_config`` set. Tokenizer files are the caller's to copy. Returns the folder.

    Example:
        >>> save_fp8_checkpoint(replay(store, "qwen-grpo", 42), "ckpt-42", hf_config)  # doctest: +SKIP
        >>> LLM("ckpt-42", quantization="fp8")  # doctest: +SKIP
    """
    if check_fp8_state(state) == 0:
        raise TensorMismatch("the state holds no float8_e4m3fn weight: it is not an FP8 serving state")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    write_state_file(out / "model.safetensors", state, metadata or {"format": "pt"})
    cfg = {**(config or {}), "quantization_config": dict(QUANTIZATION_CONFIG)}
    tmp = out / ".config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / "config.json")
    return out


__all__ = ["check_fp8_state", "save_fp8_checkpoint", "serving_state"]
