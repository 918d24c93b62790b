"""The benchmark trace generator (benchmarks/_trace.py): BF16 rounding and Adam-like change rates."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks._trace import AdamTrace, bf16_bits, qwen3_like_shapes


def test_bf16_rounding_is_nearest_even() -> None:
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 0.0, -0.0, 1e-40], dtype=np.float32)
    assert bf16_bits(x).tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x0000, 0x8000, 0x0001]


@pytest.mark.torch
def test_bf16_rounding_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 0.03
    want = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bf16_bits(x), want)


def test_adam_trace_changes_a_few_percent_then_about_one() -> None:
    shapes = qwen3_like_shapes(
        layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=512
    )
    tr = AdamTrace(shapes, seed=1, lr=1e-6)
    a = tr.export()
    first = tr.direction()
    b = tr.export(first, 1e-6)
    frac_first = np.mean(np.concatenate([(a[k].bits != b[k].bits).ravel() for k in a]))
    for name, upd in first.items():
        tr.w[name] -= np.float32(1e-6) * upd
    tr.run(5)
    c = tr.export()
    tr.step()
    d = tr.export()
    frac_steady = np.mean(np.concatenate([(c[k].bits != d[k].bits).ravel() for k in c]))
    assert 0.02 < frac_first < 0.3
    assert 0.003 < frac_steady < frac_first
