"""HF -> vLLM name and index mapping: fused qkv/gate_up, tensor-parallel shards, vocab padding (CPU only)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from deltarl.actor.backends.vllm_mapping import (  # noqa: E402
    FusedLayout,
    local_shape,
    map_sparse,
    placement,
    shard_state,
    unshard_state,
)

pytestmark = pytest.mark.torch

HEADS, KV, HD, HIDDEN, INTER, VOCAB = 8, 2, 4, 16, 24, 130


def hf_state(*, bias: bool, tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(torch.bfloat16)

    s = {"model.embed_tokens.weight": r(VOCAB, HIDDEN), "model.norm.weight": r(HIDDEN)}
    if not tied:
        s["lm_head.weight"] = r(VOCAB, HIDDEN)
    for i in range(2):
        p = f"model.layers.{i}."
        s |= {
            p + "self_attn.q_proj.weight": r(HEADS * HD, HIDDEN),
            p + "self_attn.k_proj.weight": r(KV * HD, HIDDEN),
            p + "self_attn.v_proj.weight": r(KV * HD, HIDDEN),
            p + "self_attn.o_proj.weight": r(HIDDEN, HEADS * HD),
            p + "self_attn.q_norm.weight": r(HD),
            p + "self_attn.k_norm.weight": r(HD),
            p + "mlp.gate_proj.weight": r(INTER, HIDDEN),
            p + "mlp.up_proj.weight": r(INTER, HIDDEN),
            p + "mlp.down_proj.weight": r(HIDDEN, INTER),
            p + "input_layernorm.weight": r(HIDDEN),
            p + "post_attention_layernorm.weight": r(HIDDEN),
        }
        if bias:
            s |= {p + "self_attn.q_proj.bias": r(HEADS * HD), p + "self_attn.k_proj.bias": r(KV * HD),
                  p + "self_attn.v_proj.bias": r(KV * HD)}
    return s


def layout(tp: int) -> FusedLayout:
    return FusedLayout(num_heads=HEADS, num_kv_heads=KV, head_dim=HD, intermediate_size=INTER, vocab_size=VOCAB, tp_size=tp)


def test_names() -> None:
    lay = layout(1)
    assert placement("model.layers.3.self_attn.k_proj.weight", lay, 0).target == "model.layers.3.self_attn.qkv_proj.weight"
    assert placement("model.layers.0.self_attn.v_proj.bias", lay, 0).target == "model.layers.0.self_attn.qkv_proj.bias"
    assert placement("model.layers.0.mlp.up_proj.weight", lay, 0).target == "model.layers.0.mlp.gate_up_proj.weight"
    for same in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert placement(same, lay, 0).target == same
    assert placement("model.layers.0.self_attn.q_norm.weight", lay, 0).split == "replicated"


def test_tp1_fusion_is_concatenation() -> None:
    s = hf_state(bias=True, tied=True)
    sh = shard_state(s, layout(1), 0)
    p = "model.layers.1."
    assert torch.equal(sh[p + "self_attn.qkv_proj.weight"],
                       torch.cat([s[p + "self_attn.q_proj.weight"], s[p + "self_attn.k_proj.weight"], s[p + "self_attn.v_proj.weight"]]))
    assert torch.equal(sh[p + "self_attn.qkv_proj.bias"],
                       torch.cat([s[p + "self_attn.q_proj.bias"], s[p + "self_attn.k_proj.bias"], s[p + "self_attn.v_proj.bias"]]))
    assert torch.equal(sh[p + "mlp.gate_up_proj.weight"], torch.cat([s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"]]))
    emb = sh["model.embed_tokens.weight"]
    assert emb.shape == (192, HIDDEN)  # 130 padded to a multiple of 64
    assert torch.equal(emb[:VOCAB], s["model.embed_tokens.weight"])
    assert not emb[VOCAB:].any()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_shards_follow_vllm_rules(tp: int) -> None:
    s = hf_state(bias=False, tied=False)
    lay = layout(tp)
    p = "model.layers.0."
    q, k = s[p + "self_attn.q_proj.weight"], s[p + "self_attn.k_proj.weight"]
    for rank in range(tp):
        sh = shard_state(s, lay, rank)
        qkv = sh[p + "self_attn.qkv_proj.weight"]
        q_rows = HEADS // tp * HD
        assert torch.equal(qkv[:q_rows], q[rank * q_rows : (rank + 1) * q_rows])
        kv_head = rank // max(1, tp // KV) if tp >= KV else None
        if kv_head is not None:  # one kv head per rank, replicated tp // KV times
            assert torch.equal(qkv[q_rows : q_rows + HD], k[kv_head * HD : (kv_head + 1) * HD])
        o = sh[p + "self_attn.o_proj.weight"]
        cols = HEADS * HD // tp
        assert torch.equal(o, s[p + "self_attn.o_proj.weight"][:, rank * cols : (rank + 1) * cols])
        down = sh[p + "mlp.down_proj.weight"]
        assert down.shape == (HIDDEN, INTER // tp)
        assert sh["lm_head.weight"].shape == (192 // tp, HIDDEN)
        for name in s:
            assert tuple(sh[placement(name, lay, rank).target].shape) == local_shape(name, tuple(s[name].shape), lay)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_unshard_inverts_shard(tp: int) -> None:
    s = hf_state(bias=True, tied=False)
    lay = layout(tp)
    shards = [shard_state(s, lay, r) for r in range(tp)]
    back = unshard_state(shards, {k: tuple(v.shape) for k, v in s.items()}, lay)
    assert back.keys() == s.keys()
    assert all(torch.equal(back[k], s[k]) for k in s)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 1.0])
def test_mapped_sparse_update_equals_update_then_shard(tp: int, density: float) -> None:
    """Applying mapped updates to every rank's shards == updating the HF tensors, then sharding."""
    base = hf_state(bias=True, tied=False, seed=1)
    lay = layout(tp)
    g = torch.Generator().manual_seed(int(density * 1000) + tp)
    updates = {}
    for name, t in base.items():
        n = t.numel()
        mask = torch.rand(n, generator=g) < density
        idx = torch.nonzero(mask).flatten().to(torch.int64)
        updates[name] = (idx, torch.randn(idx.numel(), generator=g).to(torch.bfloat16))
    updated = {k: v.clone() for k, v in base.items()}
    for name, (idx, vals) in updates.items():
        updated[name].view(-1)[idx] = vals
    for rank in range(tp):
        want = shard_state(updated, lay, rank)
        got = shard_state(base, lay, rank)
        written = 0
        for name, (idx, vals) in updates.items():
            target, local, v = map_sparse(name, tuple(base[name].shape), idx, vals, lay, rank)
            assert local.dtype == torch.int64
            if local.numel():
                assert int(local.max()) < got[target].numel()
            got[target].view(-1)[local] = v
            written += local.numel()
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)), (rank, k)
        if density == 1.0 and tp == 1:
            assert written == sum(t.numel() for t in base.values())


def test_vocab_rank_without_real_rows() -> None:
    lay = layout(4)  # 192 padded rows, 48 per rank: rank 3 holds only padding
    assert placement("lm_head.weight", lay, 3).size == 0
    assert placement("lm_head.weight", lay, 2).size == VOCAB - 96
    idx = torch.arange(VOCAB * HIDDEN)
    _, local, vals = map_sparse("lm_head.weight", (VOCAB, HIDDEN), idx, idx.float(), lay, 3)
    assert local.numel() == 0
    assert vals.numel() == 0


def test_layout_validation_and_from_config() -> None:
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=259, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    lay = FusedLayout.from_hf_config(cfg, tp_size=2)
    assert (lay.num_heads, lay.num_kv_heads, lay.head_dim, lay.intermediate_size, lay.vocab_size) == (4, 2, 16, 192, 259)
    with pytest.raises(ValueError, match="tp_size"):
        FusedLayout(num_heads=6, num_kv_heads=2, head_dim=4, intermediate_size=24, vocab_size=10, tp_size=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        FusedLayout(num_heads=12, num_kv_heads=3, head_dim=4, intermediate_size=24, vocab_size=10, tp_size=2)
    with pytest.raises(ValueError, match="rank"):
        placement("model.norm.weight", layout(2), 2)


def test_tiny_model_names_all_map(tiny_model: object) -> None:
    """Every tensor the trainer exports for the tiny model has a placement that shard_state accepts."""
    from deltarl.model.build import export_bf16

    state = export_bf16(tiny_model)  # type: ignore[arg-type]
    cfg = tiny_model.config  # type: ignore[attr-defined]
    for tp in (1, 2):
        lay = FusedLayout.from_hf_config(cfg, tp_size=tp)
        shards = [shard_state(state, lay, r) for r in range(tp)]
        back = unshard_state(shards, {k: tuple(v.shape) for k, v in state.items()}, lay)
        assert all(torch.equal(back[k], state[k]) for k in state)
        assert any(".qkv_proj." in k for k in shards[0])
