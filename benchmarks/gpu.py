"""deltarl's own staging and commit on a GPU, at dense (Qwen3-1.7B) and MoE (two Qwen3-30B-A3B
layers: 128 experts of gate/up/down each) shapes and as the FP8 serving state of the dense shapes
(``serve_as="fp8-block128"``: E4M3 codes and FP32 block scales, quantized on the device), from
weights made with torch alone; also, where installed, the HF backend's live CUDA weights and the
vLLM worker extension. Bit-exact against the CPU result.

Needs only PyTorch with CUDA and deltarl's small wheels (numpy, blake3, zstandard): the GPU hosts
have no vLLM, no transformers and no network. Run: ``python -m benchmarks.gpu`` (a few minutes on one
GPU). Without CUDA it prints ``skipped: no CUDA`` and exits 0; ``--allow-cpu`` runs the same torch
scatter path on CPU tensors instead (a smoke run of this script: ``--allow-cpu --quick``, in CI).

Per case: staging (decode against the live weights, positions and values moved to the device),
the commit pause (a check and ``index_copy_`` in place, synchronised), a plain ``index_copy_`` of
the same device indices and values, and a plain numpy scatter on the host, best of ``--repeat``
with a rollback in between. Writes benchmarks/results/gpu.json (not in ``--quick`` or CPU runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._synth import load, step_in_place

RESULTS = Path(__file__).resolve().parent / "results" / "gpu.json"
QWEN3_1_7B = {"hidden_size": 2048, "intermediate_size": 6144, "num_layers": 28, "num_heads": 16, "num_kv_heads": 8,
              "vocab_size": 151936, "tie_embeddings": True}  # fmt: skip
#: name -> shape of each tensor: dense Qwen3-1.7B (28 layers) and two MoE layers of Qwen3-30B-A3B
DENSE_1_7B = {"layers": 28, "hidden": 2048, "inter": 6144, "heads": 16, "kv": 8, "head_dim": 128, "vocab": 151936, "experts": 0}
MOE_30B_A3B = {"layers": 2, "hidden": 2048, "inter": 768, "heads": 32, "kv": 4, "head_dim": 128, "vocab": 151936, "experts": 128}
TINY = {"layers": 2, "hidden": 256, "inter": 128, "heads": 4, "kv": 2, "head_dim": 64, "vocab": 4096, "experts": 8}
QUICK = {"hidden_size": 256, "intermediate_size": 768, "num_layers": 4, "num_heads": 2, "num_kv_heads": 1,
         "vocab_size": 4096, "tie_embeddings": True}  # fmt: skip


def _bits(t: Any) -> np.ndarray:
    import torch

    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


def _next_version(state: dict[str, Any], fraction: float) -> dict[str, Any]:
    """A host copy of ``state`` with ~``fraction`` of its elements moved by +-1-2 ulp."""
    import torch

    out = {}
    for i, (name, t) in enumerate(state.items()):
        bits = _bits(t).copy()
        step_in_place(bits, fraction, 7000 + i)
        out[name] = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(t.shape)
    return out


def _raw(t: Any) -> np.ndarray:
    """The bytes of a tensor of any dtype (BF16, FP8 codes, FP32 scales), on the host."""
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_hf(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """The HF backend's live weights on ``device``: stage, commit pause, rollback, bit-exact."""
    import torch

    from deltarl.actor.backends.hf import HFBackend
    from deltarl.codec import encode_delta, stage_delta
    from deltarl.model.build import ModelSpec, build_model

    spec = ModelSpec(**(QUICK if args.quick else QWEN3_1_7B))
    t = time.perf_counter()
    backend = HFBackend(build_model(spec, dtype=torch.bfloat16, device=device), eos_token_id=0, pad_token_id=0)
    live = backend.state_dict_for_update()
    old = {k: v.detach().cpu().clone() for k, v in live.items()}
    new = _next_version(old, args.fraction)
    elements = sum(v.numel() for v in old.values())
    out: dict[str, Any] = {"device": str(device), "tensors": len(live), "elements": elements,
                           "build_s": round(time.perf_counter() - t, 2)}  # fmt: skip
    t = time.perf_counter()
    segs = encode_delta(old, new, base="b")
    out["encode_s"] = round(time.perf_counter() - t, 3)
    out["segments"] = len(segs)
    # the CPU result: the numpy path on a host copy
    cpu_state = {k: v.clone() for k, v in old.items()}
    t = time.perf_counter()
    cpu_upd = stage_delta(cpu_state, segs, base="b")
    out["cpu_stage_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    cpu_upd.commit()
    out["cpu_commit_s"] = round(time.perf_counter() - t, 4)
    out["changed"] = cpu_upd.changed_elements
    assert all(np.array_equal(_bits(cpu_state[k]), _bits(new[k])) for k in new), "CPU commit is not bit-exact"
    plain = {k: (cpu_state[k].view(-1).view(torch.int16).numpy(), *v) for k, v in cpu_upd.changes().items()}
    cpu_upd.rollback()
    t = time.perf_counter()
    for flat, pos, _o, n in plain.values():
        flat[pos] = n.view(np.int16)
    out["numpy_scatter_s"] = round(time.perf_counter() - t, 4)
    del plain, cpu_upd, cpu_state
    # the device path: staged against the live weights, committed by the backend
    _sync(device)
    t = time.perf_counter()
    upd = stage_delta(live, segs, base="b", torch_scatter=True)
    _sync(device)
    out["stage_s"] = round(time.perf_counter() - t, 3)
    out["staged_host_bytes"] = upd.host_bytes
    pauses, rollbacks, plain_s = [], [], []
    plans = [p[2] for p in upd._prepared.values()]
    for rep in range(args.repeat):
        _sync(device)
        t = time.perf_counter()
        backend.commit(upd)
        _sync(device)
        pauses.append(time.perf_counter() - t)
        if rep == 0:
            assert all(np.array_equal(_bits(live[k]), _bits(new[k])) for k in new), "device commit is not bit-exact"
        t = time.perf_counter()
        upd.rollback()
        _sync(device)
        rollbacks.append(time.perf_counter() - t)
        t = time.perf_counter()
        for p in plans:  # the plain scatter of the same device indices and values, unchecked
            p.flat.index_copy_(0, p.idx, p.new)
        _sync(device)
        plain_s.append(time.perf_counter() - t)
        upd.rollback()
    assert all(np.array_equal(_bits(live[k]), _bits(old[k])) for k in old), "device rollback is not exact"
    out["pause_s"] = round(min(pauses), 5)
    out["pause_runs_s"] = [round(x, 5) for x in pauses]
    out["rollback_s"] = round(min(rollbacks), 5)
    out["plain_index_copy_s"] = round(min(plain_s), 5)
    out["pause_vs_plain_index_copy"] = round(min(pauses) / min(plain_s), 3)
    out["bit_exact"] = True
    out["load"] = load()
    return out


def state_shapes(cfg: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of a Qwen3 (dense) or Qwen3-MoE model (one tensor per expert projection)."""
    h, d = cfg["hidden"], cfg["head_dim"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab"], h), "lm_head.weight": (cfg["vocab"], h)}
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (cfg["heads"] * d, h), p + "self_attn.k_proj.weight": (cfg["kv"] * d, h),
                p + "self_attn.v_proj.weight": (cfg["kv"] * d, h), p + "self_attn.o_proj.weight": (h, cfg["heads"] * d),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if not cfg["experts"]:
            out |= {p + "mlp.gate_proj.weight": (cfg["inter"], h), p + "mlp.up_proj.weight": (cfg["inter"], h),
                    p + "mlp.down_proj.weight": (h, cfg["inter"])}
            continue
        out[p + "mlp.gate.weight"] = (cfg["experts"], h)
        for e in range(cfg["experts"]):
            q = f"{p}mlp.experts.{e}."
            out |= {q + "gate_proj.weight": (cfg["inter"], h), q + "up_proj.weight": (cfg["inter"], h),
                    q + "down_proj.weight": (h, cfg["inter"])}
    return out


def bench_state(args: argparse.Namespace, device: Any, name: str, cfg: dict[str, int], fp8: bool = False) -> dict[str, Any]:
    """deltarl's staging (decode on the host against the device's weights, positions and values moved
    to the device) and commit (a checked ``index_copy_``) of one version of a synthetic state made
    with torch on ``device``, against a plain ``index_copy_`` of the same changes; bit-exact. With
    ``fp8`` the two versions are the FP8 serving states of the BF16 ones, quantized on ``device``."""
    import torch

    from deltarl.codec import encode_delta, stage_delta
    from deltarl.codec.fp8 import quantize_state

    gen = torch.Generator(device="cpu").manual_seed(11)
    old = {n: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) for n, shape in state_shapes(cfg).items()}
    new = _next_version(old, args.fraction)
    if fp8:
        t = time.perf_counter()
        old, new = ({k: v.cpu() for k, v in quantize_state({k: v.to(device) for k, v in s.items()}).items()} for s in (old, new))
        quantize_s = time.perf_counter() - t
    t = time.perf_counter()
    segs = encode_delta(old, new, base="b")
    out: dict[str, Any] = {"case": name, "tensors": len(old), "elements": sum(v.numel() for v in old.values()),
                           "delta_bytes": sum(len(s) for s in segs), "encode_s": round(time.perf_counter() - t, 2)}
    if fp8:
        out["quantize_two_versions_s"] = round(quantize_s, 2)
    live = {n: v.to(device) for n, v in old.items()}
    _sync(device)
    t = time.perf_counter()
    upd = stage_delta(live, segs, base="b", torch_scatter=True)
    _sync(device)
    out["stage_s"] = round(time.perf_counter() - t, 4)
    out["changed"] = upd.changed_elements
    plans = [p[2] for p in upd._prepared.values()]
    pauses, plain_s = [], []
    for rep in range(args.repeat):
        _sync(device)
        t = time.perf_counter()
        upd.commit()
        _sync(device)
        pauses.append(time.perf_counter() - t)
        if rep == 0:
            assert all(np.array_equal(_raw(live[k]), _raw(new[k])) for k in new), f"{name}: commit is not bit-exact"
        upd.rollback()
        _sync(device)
        t = time.perf_counter()
        for p in plans:  # the plain scatter of the same device indices and values, unchecked
            p.flat.index_copy_(0, p.idx, p.new)
        _sync(device)
        plain_s.append(time.perf_counter() - t)
        upd.rollback()
    assert all(np.array_equal(_raw(live[k]), _raw(old[k])) for k in old), f"{name}: rollback is not exact"
    out |= {"pause_s": round(min(pauses), 5), "plain_index_copy_s": round(min(plain_s), 5),
            "pause_vs_plain_index_copy": round(min(pauses) / min(plain_s), 3), "bit_exact": True}
    return out


def bench_vllm(args: argparse.Namespace) -> dict[str, Any]:
    """The deltarl weight-transfer engine inside vLLM on CUDA: ``benchmarks.vllm_update`` (tiny
    shapes with --quick, else Qwen3-0.6B), its plain scatter reference on the same device."""
    from benchmarks import vllm_update

    ns = argparse.Namespace(shape="tiny" if args.quick else "0.6b", versions=3, fraction=args.fraction, workdir=None,
                            device="cuda", gpu_memory_utilization=0.3)
    r = vllm_update.run(ns)
    m = r["median"]
    return {"shape": r["shape"], "pause_s": m["pause_s"], "scatter_s": m["scatter_s"], "vllm_sparse_s": m["vllm_sparse_s"],
            "pause_over_scatter": round(r["pause_over_scatter"], 3), "pause_over_vllm_sparse": round(r["pause_over_vllm_sparse"], 4),
            "final_version": r["final_version"], "load": load()}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    ap.add_argument("--allow-cpu", action="store_true", help="without CUDA, run the torch scatter path on CPU")
    ap.add_argument("--out", type=Path, default=None, help=f"where the JSON goes (default {RESULTS} on a CUDA host's full run)")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("skipped: no CUDA (torch is not installed)")
        return 0
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print(f"skipped: no CUDA (torch {torch.__version__}, torch.cuda.is_available() is False)")
        return 0
    device = torch.device("cuda" if cuda else "cpu")
    res: dict[str, Any] = {"benchmark": "gpu", "torch": torch.__version__, "cpus": os.cpu_count(),
                           "gpu": torch.cuda.get_device_name(device) if cuda else None, "quick": args.quick}  # fmt: skip
    cases = {"dense": TINY | {"experts": 0}, "moe": TINY} if args.quick else {"dense-qwen3-1.7b": DENSE_1_7B,
                                                                          "moe-qwen3-30b-a3b-2-layers": MOE_30B_A3B}
    res["states"] = [bench_state(args, device, name, cfg) for name, cfg in cases.items()]
    dense_name, dense = next(iter(cases.items()))
    res["states"].append(bench_state(args, device, f"{dense_name}-fp8", dense, fp8=True))
    for r in res["states"]:
        print(f"{r['case']:28s} {r['elements'] / 1e9:.2f}e9 in {r['tensors']} tensors: stage {r['stage_s'] * 1e3:.1f} ms, "
              f"pause {r['pause_s'] * 1e3:.2f} ms = x{r['pause_vs_plain_index_copy']} plain index_copy_ "
              f"({r['plain_index_copy_s'] * 1e3:.2f} ms), bit-exact")
    try:
        import transformers  # noqa: F401
    except ImportError:
        res["hf"] = "skipped: transformers not installed"
        print("HF backend: skipped (transformers not installed)")
        return _write(res, cuda, args)
    res["hf"] = bench_hf(args, device)
    try:
        import vllm  # noqa: F401
    except ImportError:
        res["vllm"] = "skipped: vLLM not installed"
    else:
        res["vllm"] = bench_vllm(args) if cuda else "skipped: vLLM needs CUDA"
    hf = res["hf"]
    rows = [
        ("device", f"{hf['device']} {res['gpu'] or ''}".strip()),
        ("state", f"{hf['elements'] / 1e9:.2f}e9 BF16 in {hf['tensors']} tensors, {hf['changed'] / 1e6:.2f}M changed, {hf['segments']} segments"),
        ("stage on device", f"{hf['stage_s']} s"),
        ("commit pause (HF backend)", f"{hf['pause_s'] * 1e3:.2f} ms (x{hf['pause_vs_plain_index_copy']} plain index_copy_ {hf['plain_index_copy_s'] * 1e3:.2f} ms)"),
        ("rollback", f"{hf['rollback_s'] * 1e3:.2f} ms"),
        ("host: CPU commit / numpy scatter", f"{hf['cpu_commit_s'] * 1e3:.1f} / {hf['numpy_scatter_s'] * 1e3:.1f} ms"),
        ("bit-exact vs CPU", str(hf["bit_exact"])),
        ("vLLM deltarl engine", res["vllm"] if isinstance(res["vllm"], str)
         else f"pause {res['vllm']['pause_s'] * 1e3:.1f} ms (x{res['vllm']['pause_over_scatter']} plain scatter, "
              f"x{res['vllm']['pause_over_vllm_sparse']} vLLM sparse)"),
        ("load average", str(hf["load"])),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")
    return _write(res, cuda, args)


def _write(res: dict[str, Any], cuda: bool, args: argparse.Namespace) -> int:
    out = args.out or (RESULTS if cuda and not args.quick else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
