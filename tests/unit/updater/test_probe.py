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


def _tp_loader(params: dict[str, Any], rank: int, tp: int) -> Any:
    """vLLM-style tensor parallel rank: q rows narrowed (column-parallel), o columns narrowed
    (row-parallel), one KV head replicated on every rank, expert 0 on rank 0 only (expert parallel)."""

    def load(weights: Iterable[tuple[str, Any]]) -> None:
        for name, t in weights:
            if name == "q.weight":
                params["q"].copy_(t.narrow(0, rank * (Q // tp), Q // tp))
            elif name == "o.weight":
                params["o"].copy_(t.narrow(1, rank * (Q // tp), Q // tp))
            elif name == "k.weight":
                params["k"].copy_(t[:2])  # replicated: every rank the same rows
            elif name == "e0.weight" and rank == 0:
                params["w13"][0].copy_(t)

    return load


TP_SPECS = [TensorSpec("q.weight", "bfloat16", (Q, H)), TensorSpec("o.weight", "bfloat16", (H, Q)),
            TensorSpec("k.weight", "bfloat16", (KV, H)), TensorSpec("e0.weight", "bfloat16", (4, H))]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_maps_row_ranges_column_blocks_and_absent_experts(rank: int) -> None:
    tp = 2
    params = {"q": torch.randn(Q // tp, H).to(torch.bfloat16), "o": torch.randn(H, Q // tp).to(torch.bfloat16),
              "k": torch.randn(2, H).to(torch.bfloat16), "w13": torch.randn(2, 4, H).to(torch.bfloat16)}
    served = {n: p.clone() for n, p in params.items()}
    views, placements = derive_views(_tp_loader(params, rank, tp), params, TP_SPECS, sharded=True)
    regions = {p.name: (p.region.kind, p.region.start, p.region.stop) for p in placements}
    want = {"q.weight": ("rows", rank * 4, rank * 4 + 4), "o.weight": ("cols", rank * 4, rank * 4 + 4),
            "k.weight": ("rows", 0, 2)}
    if rank == 0:
        want["e0.weight"] = ("whole", 0, 4)
    assert regions == want
    assert all(torch.equal(params[n], served[n]) for n in params)  # the probe put the served values back
    full = torch.randn(H, Q).to(torch.bfloat16)
    _tp_loader(params, rank, tp)([("o.weight", full)])
    assert torch.equal(views["o.weight"], full[:, rank * 4 : rank * 4 + 4])  # the view is the rank's column block


def test_a_partial_tensor_is_refused_unless_sharded() -> None:
    params = {"q": torch.zeros(Q // 2, H, dtype=torch.bfloat16), "o": torch.zeros(H, Q // 2, dtype=torch.bfloat16),
              "k": torch.zeros(2, H, dtype=torch.bfloat16), "w13": torch.zeros(2, 4, H, dtype=torch.bfloat16)}
    with pytest.raises(TensorMismatch, match="holds rows"):
        derive_views(_tp_loader(params, 0, 2), params, TP_SPECS)


def test_tensors_past_one_index_digit_are_located_by_two() -> None:
    """A tensor of more elements than one probe code tells apart (61440): a high digit pass first."""
    rows, cols = 320, 256  # 81920 elements
    spec = TensorSpec("big.weight", "bfloat16", (rows, cols))
    params = {"big": torch.zeros(rows, cols // 2, dtype=torch.bfloat16)}

    def load(weights: Iterable[tuple[str, Any]]) -> None:
        for _, t in weights:
            params["big"].copy_(t[:, cols // 2 :])  # the second column block (a row-parallel rank 1)

    views, placements = derive_views(load, params, [spec], sharded=True)
    assert (placements[0].region.kind, placements[0].region.start, placements[0].region.stop) == ("cols", cols // 2, cols)
    assert views["big.weight"].shape == (rows, cols // 2)
