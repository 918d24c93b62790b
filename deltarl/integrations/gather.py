"""The full BF16 state of a model as training frameworks hold it: sharded, wrapped, with adapters.

:func:`gather_bf16` is collective: every rank calls it with its own shard, and rank 0 gets the whole
export (the names and bits ``deltarl.model.export_bf16`` gives for the unwrapped, merged model);
other ranks get ``{}``. Parameters are gathered one at a time, so the peak extra memory on a device
is one full parameter, and CPU memory holds one BF16 copy of the model on rank 0 only.

* DeepSpeed ZeRO-3 parameters (``ds_id``) are gathered with ``deepspeed.zero.GatheredParameters``;
* FSDP2 / DTensor parameters with ``full_tensor()``;
* FSDP1 modules inside ``FullyShardedDataParallel.summon_full_params`` (no writeback);
* PEFT LoRA models are merged the way ``merge_and_unload`` merges (``W + B @ A * scaling``, in the
  weight's dtype) from the gathered tensors, without touching the training weights or adapters.

Wrapper prefixes (``module.`` of DDP, ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``,
``_orig_mod.`` of ``torch.compile``) are dropped from names.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from deltarl.errors import IntegrationError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_WRAPPERS = re.compile(r"(^|\.)(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")
_PEFT_PREFIX = "base_model.model."


def clean_name(name: str) -> str:
    """``name`` without the wrapper modules' segments (FSDP, activation checkpointing, compile)."""
    while True:
        new = _WRAPPERS.sub(r"\1", name)
        if new == name:
            return name
        name = new


def unwrap(model: Any) -> Any:
    """The model inside DDP / DeepSpeed engine / ``torch.compile`` wrappers (FSDP stays: it gathers)."""
    while True:
        inner = getattr(model, "module", None) if type(model).__name__ in ("DistributedDataParallel",
                                                                             "DeepSpeedEngine") else None
        inner = inner if inner is not None else getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def _is_fsdp1(model: Any) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


@contextlib.contextmanager
def _full_params(model: Any) -> Iterator[None]:
    """FSDP1: every rank holds the full parameters inside (no writeback); others: nothing to do."""
    if _is_fsdp1(model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True):
            yield
    else:
        yield


@contextlib.contextmanager
def _gathered(param: Any) -> Iterator[Any]:
    """``param`` whole on this rank for the duration (collective for ZeRO-3 and DTensor)."""
    if hasattr(param, "ds_id"):  # DeepSpeed ZeRO-3 partitioned parameter
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            yield param.data
        return
    data = param.data
    if hasattr(data, "full_tensor"):  # DTensor (FSDP2, tensor parallel)
        yield data.full_tensor()
        return
    yield data


def _gather_all(model: Any, keep: bool, exact: frozenset[str]) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` whole, by cleaned name, as CPU copies where ``keep``: BF16 straight
    away (one pass, one BF16 copy of the model), except the names in ``exact``, kept in their training
    dtype so a LoRA merge computes as PEFT does."""
    import torch

    out: dict[str, torch.Tensor] = {}
    with torch.no_grad(), _full_params(model):
        for name, param in model.named_parameters():
            with _gathered(param) as full:
                if keep:
                    key = clean_name(name)
                    dtype = full.dtype if key in exact else torch.bfloat16
                    out[key] = full.detach().to("cpu", dtype=dtype, copy=True)
    return out


def _lora_layers(model: Any) -> list[tuple[str, str, float, bool]]:
    """``(module name, adapter, scaling, fan_in_fan_out)`` of every active LoRA linear layer."""
    layers = []
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "scaling"):
            continue
        adapters = module.active_adapters if hasattr(module, "active_adapters") else [module.active_adapter]
        for adapter in adapters:
            if (adapter in getattr(module, "lora_embedding_A", {}) or getattr(module, "use_dora", {}).get(adapter)
                    or getattr(module, "lora_bias", {}).get(adapter)):
                raise IntegrationError(f"{name}: adapter {adapter!r} is a LoRA embedding, DoRA or lora_bias layer, "
                                       "which deltarl does not merge; merge it into the model before publishing")
            if adapter not in module.lora_A:
                continue
            if type(module).__name__ != "Linear":
                raise IntegrationError(f"{name}: LoRA on a {type(module).__name__} layer is not merged by deltarl; "
                                       "merge it into the model before publishing")
            layers.append((clean_name(name), adapter, float(module.scaling[adapter]),
                           bool(getattr(module, "fan_in_fan_out", False))))
    return layers


def _merge_lora(raw: dict[str, torch.Tensor], layers: list[tuple[str, str, float, bool]]) -> dict[str, torch.Tensor]:
    """The state ``merge_and_unload`` would leave: LoRA folded into the base weights, names unwrapped."""
    import torch

    merged = dict(raw)
    for name, adapter, scaling, fan_in_fan_out in layers:
        base_key = f"{name}.base_layer.weight"
        a = merged.pop(f"{name}.lora_A.{adapter}.weight")
        b = merged.pop(f"{name}.lora_B.{adapter}.weight")
        half = b.dtype in (torch.float16, torch.bfloat16)  # PEFT merges half adapters on CPU in FP32
        product = b.float() @ a.float() if half else b @ a
        delta = (product.T if fan_in_fan_out else product) * scaling
        delta = delta.to(b.dtype)
        base = merged[base_key]  # PEFT adds in place: computed in the promoted dtype, rounded once
        wide = torch.promote_types(base.dtype, delta.dtype)
        merged[base_key] = (base.to(wide) + delta.to(wide)).to(base.dtype)
    out: dict[str, torch.Tensor] = {}
    for key, value in merged.items():
        if ".lora_" in key or ".original_module." in key:
            continue  # other (inactive) adapters, and the originals modules_to_save replaces
        key = key.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
        key = re.sub(r"\.modules_to_save\.[^.]+\.", ".", key)
        out[key] = value
    return out


def is_peft(model: Any) -> bool:
    """Whether ``model`` is a PEFT model (adapters on a base model)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def gather_bf16(model: Any, *, is_main: bool) -> dict[str, torch.Tensor]:
    """Collective: the full export of ``model`` (contiguous CPU BF16) on the rank with ``is_main``, ``{}``
    on the others. Every rank must call it at the same point with its own shard of the same model."""
    import torch

    model = unwrap(model)
    layers = _lora_layers(model) if is_peft(model) else []
    exact = frozenset(f"{name}.{part}" for name, adapter, _, _ in layers
                      for part in ("base_layer.weight", f"lora_A.{adapter}.weight", f"lora_B.{adapter}.weight"))
    raw = _gather_all(model, keep=is_main, exact=exact)
    if not is_main:
        return {}
    if is_peft(model):
        raw = _merge_lora(raw, layers)
    return {name: t.to(torch.bfloat16).contiguous() for name, t in raw.items()}
