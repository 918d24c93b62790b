"""The load_weights probe of the in-place updater (deltarl.updater.probe), on loaders written
the way vLLM's are (fused rows, padded vocabularies), without vLLM: the layouts it accepts as views
and the ones it must refuse."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from deltarl.codec.tensors import TensorSpec  # noqa: E402
from deltarl.errors import TensorMismatch  # noqa: E402
from deltarl.updater.probe import derive_views  # noqa: E402

H, Q, KV, V, PAD = 8, 8, 4, 10, 16
SPECS = [TensorSpec("embed.weight", "bfloat16", (V, H)), TensorSpec("q.weight", "bfloat16", (Q, H)),
         TensorSpec("k.weight", "bfloat16", (KV, H)), TensorSpec("v.weight", "bfloat16", (KV, H)),
         TensorSpec("norm.weight", "bfloat16", (H,))]


def _params() -> dict[str, Any]:
    return {"embed": torch.zeros(PAD, H, dtype=torch.bfloat16), "qkv": torch.zeros(Q + 2 * KV, H, dtype=torch.bfloat16),
            "norm": torch.zeros(H, dtype=torch.bfloat16)}


def _fused_loader(params: dict[str, Any], *, transpose_k: bool = False, split_v: bool = False) -> Any:
    """vLLM-style: q/k/v stacked into qkv rows, the vocabulary padded to PAD rows."""
    rows = {"q.weight": 0, "k.weight": Q, "v.weight": Q + KV}

    def load(weights: Iterable[tuple[str, Any]]) -> None:
        for name, t in weights:
            if name == "embed.weight":
                params["embed"][:V].copy_(t)
            elif name == "norm.weight":
                params["norm"].copy_(t)
            elif name == "k.weight" and transpose_k:
                params["qkv"][Q : Q + KV].copy_(t.reshape(H, KV).t())
            elif name == "v.weight" and split_v:
                params["qkv"][Q + KV : Q + KV + 2].copy_(t[:2])
                params["embed"][V : V + 2].copy_(t[2:])
            else:
                params["qkv"][rows[name] : rows[name] + t.shape[0]].copy_(t)

    return load


def test_fused_and_padded_layouts_become_views_of_the_parameters() -> None:
    params = _params()
    views, placements = derive_views(_fused_loader(params), params, SPECS)
    assert {p.name: (p.param, p.start) for p in placements} == {
        "embed.weight": ("embed", 0), "q.weight": ("qkv", 0), "k.weight": ("qkv", Q * H), "v.weight": ("qkv", (Q + KV) * H),
        "norm.weight": ("norm", 0)}
    views["k.weight"][1, 2] = 3.0  # a write through the view is a write to the fused parameter
    assert params["qkv"][Q + 1, 2] == 3.0
    assert torch.count_nonzero(params["embed"][V:]) == 0  # padding rows: zero, never the probe's sentinel
    assert all(v.is_contiguous() and tuple(v.shape) == s.shape for v, s in zip(views.values(), SPECS, strict=True))


@pytest.mark.parametrize(("kind", "message"), [("transpose_k", "reorders"), ("split_v", "lands in")])
def test_reordered_or_split_tensors_are_refused(kind: str, message: str) -> None:
    params = _params()
    with pytest.raises(TensorMismatch, match=message):
        derive_views(_fused_loader(params, **{kind: True}), params, SPECS)


def test_a_tensor_the_loader_drops_is_refused() -> None:
    params = _params()
    loader = _fused_loader(params)
    with pytest.raises(TensorMismatch, match=r"norm\.weight .* lands in 0 piece"):
        derive_views(lambda ws: loader((n, t) for n, t in ws if n != "norm.weight"), params, SPECS)
