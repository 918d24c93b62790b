"""Model construction and the BF16 export the publisher ships.

``ModelSpec(name="tiny")`` builds a small Qwen3-architecture model from a ``transformers`` config
(deterministic init from ``seed``); any other ``name`` is a local Hugging Face checkpoint directory,
loaded with ``local_files_only=True``. Nothing is downloaded.

The exported state is ``model.named_parameters()`` (tied weights appear once, under their first
name) as contiguous CPU BF16 tensors. Actors serve exactly these tensors: the names, shapes and
bits of an actor's live parameters equal the trainer's export, so state digests compare.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deltarl.errors import ConfigError, TensorMismatch

if TYPE_CHECKING:
    import torch

class ModelSpec(BaseModel):
    """Which model a run trains: the built-in ``tiny`` Qwen3, or a local HF checkpoint path."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(default="tiny", description="'tiny' or the path of a local Hugging Face checkpoint directory")
    hidden_size: int = Field(default=64, ge=8, le=4096, description="tiny: hidden width")
    intermediate_size: int = Field(default=192, ge=8, le=16384, description="tiny: MLP width")
    num_layers: int = Field(default=2, ge=1, le=64, description="tiny: decoder layers")
    num_heads: int = Field(default=4, ge=1, le=128, description="tiny: attention heads")
    num_kv_heads: int = Field(default=2, ge=1, le=128, description="tiny: key/value heads (GQA)")
    max_positions: int = Field(default=256, ge=16, le=1 << 20, description="tiny: maximum sequence length")
    tie_embeddings: bool = Field(default=True, description="tiny: share the input embedding with the LM head")
    vocab_size: int = Field(default=259, ge=2, le=1 << 20, description="tiny: vocabulary size (the tokenizer's)")
    seed: int = Field(default=0, ge=0, description="tiny: seed of the deterministic initialisation")
    init_std: float = Field(default=0.02, gt=0, le=1.0, description="tiny: std of the normal weight init")

    @model_validator(mode="after")
    def _check_heads(self) -> ModelSpec:
        if self.name == "tiny":
            if self.hidden_size % self.num_heads:
                raise ValueError("hidden_size must be a multiple of num_heads")
            if self.num_heads % self.num_kv_heads:
                raise ValueError("num_heads must be a multiple of num_kv_heads")
        return self

    @property
    def is_tiny(self) -> bool:
        return self.name == "tiny"


def tiny_config(spec: ModelSpec) -> Any:
    """The ``transformers.Qwen3Config`` of a tiny spec."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=spec.tie_embeddings,
        initializer_range=spec.init_std,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


def build_model(spec: ModelSpec, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Build the model of ``spec`` in ``dtype`` (default FP32) on ``device``, in eval mode.

    ``tiny`` initialises deterministically from ``spec.seed`` (same bits on every machine for the
    same torch version) without touching the global RNG; a path loads that local checkpoint.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    dtype = dtype or torch.float32
    if spec.is_tiny:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model: torch.nn.Module = Qwen3ForCausalLM(tiny_config(spec))
        model = model.to(dtype=dtype)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(spec.name, local_files_only=True, dtype=dtype)
        except OSError as err:
            raise ConfigError(f"no local checkpoint at {spec.name!r}: {err}") from err
    model.to(device)
    model.eval()
    return model


def export_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The inference-dtype state the publisher ships: contiguous CPU BF16 copies, tied weights once."""
    import torch

    with torch.no_grad():
        return {
            name: p.detach().to(device="cpu", dtype=torch.bfloat16, copy=True).contiguous()
            for name, p in model.named_parameters()
        }


def live_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameter tensors themselves (no copies), by export name, for in-place updates."""
    return {name: p.data for name, p in model.named_parameters()}


def load_bf16_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy an exported state into ``model``'s parameters in place (cast to their dtype).

    Every exported name must be present with the right shape, and nothing else; otherwise
    ``TensorMismatch`` is raised before anything is written.
    """
    import torch

    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    extra = sorted(set(state) - set(params))
    if missing or extra:
        raise TensorMismatch(f"state does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, p in params.items():
        if tuple(state[name].shape) != tuple(p.shape):
            raise TensorMismatch(f"{name}: shape {tuple(state[name].shape)} != model's {tuple(p.shape)}")
    with torch.no_grad():
        for name, p in params.items():
            p.data.copy_(state[name].to(device=p.device, dtype=p.dtype))
