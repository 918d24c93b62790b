"""deltarl's weight-transfer engine inside vLLM (CPU build): what one version costs the engine.

A random-init checkpoint with Qwen3-0.6B (or 1.7B) shapes is written locally; ``--versions``
versions, each changing ``--fraction`` of every tensor's BF16 elements by a few ulps, are
published to a local store. One vLLM engine (``weight_transfer_config={"backend": "deltarl"}``)
attaches to the run at version 0, then per version, in the same engine and the same run:

* **deltarl**: ``update_weights`` (fetch + decode in the worker, off the pause), then
  ``finish_weight_update`` (the pause: the checked in-place scatter), as the worker times them;
* **plain scatter**: ``index_copy_`` of the same positions and values into a BF16 state in this
  process (the floor any in-place path pays; same device, same changes);
* **vLLM sparse**: vLLM's own ``load_checkpoint_weight_patches`` of the same changes, on the same
  engine's model (they write the values deltarl just wrote: the same work, no change);
* **dense reload**: ``model.load_weights`` of the whole state.

Also: the worker's resident memory beyond vLLM's own (after loading, before deltarl attaches) in
BF16 model copies, and the bytes of vLLM's RPC messages an update sends (msgpack, as vLLM encodes).

With ``--tp 2`` (vLLM's CPU build: one core a rank) each rank reads and stages only its part: per
rank, the bytes it fetched against the version's delta bytes and its fetch + decode + stage time
(``stage_s``), beside the same run at TP 1 (``--compare-tp1`` runs both). MoE shapes (``moe-*``:
Qwen3-30B-A3B layers, 128 experts, one tensor per expert and projection as the released checkpoints
hold them) run the same; vLLM's own sparse path and the dense reload are measured at TP 1 on dense
shapes only (they read the model whole).

    python -m benchmarks.vllm_update [--shape 0.6b|1.7b|moe-tiny|moe-30b-a3b-layer|moe-30b-a3b] [--tp 1|2]
        [--versions 3] [--fraction 0.01]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "vllm_update.json"

SHAPES = {  # Qwen3 dense configs (config.json of the released checkpoints), weights random; tiny: a smoke run
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096, "tie_word_embeddings": True},
    "0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True},
    "1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True},
    # Qwen3-MoE: a tiny smoke shape, and two layers of Qwen3-30B-A3B (128 experts of 768, 8 active)
    "moe-tiny": {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": 8,
                 "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 64, "vocab_size": 4096, "tie_word_embeddings": False},
    # one Qwen3-30B-A3B layer (388 tensors: 128 experts of 768) under a small vocabulary: ~1.4 GB, fits a small host
    "moe-30b-a3b-layer": {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                          "num_experts_per_tok": 8, "num_hidden_layers": 1, "num_attention_heads": 32,
                          "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 16384, "tie_word_embeddings": False},
    "moe-30b-a3b": {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                    "num_experts_per_tok": 8, "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4,
                    "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False},
}


def _per_expert(ckpt: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's fused experts (transformers' ``gate_up_proj`` ``[E, 2I, H]``, ``down_proj``
    ``[E, H, I]``) rewritten one tensor per expert and projection, as the released Qwen3-MoE
    checkpoints hold them (``experts.{e}.gate_proj.weight`` ...; vLLM loads either); the new state."""
    from safetensors.torch import save_file

    out: dict[str, Any] = {}
    for name, t in state.items():
        prefix, _, last = name.rpartition(".")
        if last == "gate_up_proj":
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1), strict=True)):
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate.clone(), up.clone()
        elif last == "down_proj" and t.dim() == 3:
            for e, down in enumerate(t):
                out[f"{prefix}.{e}.down_proj.weight"] = down.clone()
        else:
            out[name] = t
    for f in [*ckpt.glob("*.safetensors"), *ckpt.glob("*.safetensors.index.json")]:
        f.unlink()
    save_file(out, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    return out


def _scatter_s(state: dict[str, Any], changes: dict[str, tuple[Any, Any]], repeats: int = 5, *, sync: bool = False) -> float:
    """Median seconds of a plain ``index_copy_`` of ``changes`` into ``state``."""
    import torch

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for name, (idx, vals) in changes.items():
            state[name].view(-1).index_copy_(0, idx, vals)
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rpc_bytes(version: int) -> int:
    """Bytes of the three control messages one update sends (vLLM's msgpack encoder)."""
    from vllm.v1.serial_utils import MsgpackEncoder

    enc = MsgpackEncoder()
    msgs = [("start_weight_update", (), {}), ("update_weights", (), {"update_info": {"version": version, "wait_s": 0.0}}),
            ("finish_weight_update", (), {})]
    return sum(sum(len(b) for b in enc.encode(m)) for m in msgs)


def _memory(llm: Any) -> dict[str, int]:
    """The largest resident and peak resident bytes over the engine's workers (ranks)."""
    from deltarl.testing import vllm_runs

    mems = llm.collective_rpc(vllm_runs.worker_memory)
    return {k: max(m[k] for m in mems) for k in ("VmRSS", "VmHWM")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One measured run (see the module docstring); its checkpoint and store are removed after."""
    import shutil

    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-", dir=getattr(args, "workdir", None)))
    try:
        return _run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from deltarl.integrations.vllm.plugin import request_amx

    request_amx()  # before vLLM starts (deltarl.integrations.vllm.plugin)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the measuring callables below run in the worker
    import torch
    from transformers import Qwen3Config, Qwen3MoeConfig

    from deltarl.codec.heap import trim
    from deltarl.integrations.vllm import ENGINE_KWARGS, attach, status, update
    from deltarl.model.build import ModelSpec
    from deltarl.pipeline.publisher import Publisher
    from deltarl.storage.open import open_store
    from deltarl.testing import vllm_runs

    moe = args.shape.startswith("moe")
    cfg = (Qwen3MoeConfig if moe else Qwen3Config)(**SHAPES[args.shape], max_position_embeddings=4096)
    tp = getattr(args, "tp", 1)
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))  # one core a rank
    t0 = time.perf_counter()
    state = vllm_runs.write_checkpoint(tmp / "ckpt", ModelSpec(seed=1), config=cfg)
    if moe:
        state = _per_expert(tmp / "ckpt", state)
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"checkpoint: {model_bytes / 1e9:.2f} GB BF16 in {time.perf_counter() - t0:.0f} s", flush=True)
    store = open_store(str(tmp / "store"))
    changes: list[dict[str, Any]] = [{}]
    scatter: list[float] = [0.0]
    with Publisher(store, "bench", keyframe_interval=1000, digest_interval=1000) as pub:
        pub.publish(state, 0)
        for v in range(1, args.versions + 1):
            new = vllm_runs.evolve(state, args.fraction, seed=v)
            ch = vllm_runs.changes_between(state, new)
            if v == args.versions:  # the old values too: the pause is taken apart on this version
                torch.save({n: state[n].view(-1)[idx].clone() for n, (idx, _) in ch.items()}, tmp / "old-last.pt")
            pub.publish(new, v, owned=True)
            state = new
            torch.save({n: (tuple(state[n].shape), idx, vals) for n, (idx, vals) in ch.items()}, tmp / f"changes-{v}.pt")
            changes.append(ch)
    store.close()
    delta_bytes = [0] + [sum(f.stat().st_size for f in (tmp / "store" / "bench" / "versions" / f"{v:012d}").glob("*-seg-*.bin"))
                         for v in range(1, args.versions + 1)]
    device = getattr(args, "device", "cpu")  # the engine's device: the scatter runs there too
    if device != "cpu":
        state = {n: t.to(device) for n, t in state.items()}
        changes = [{n: (i.to(device), x.to(device)) for n, (i, x) in ch.items()} for ch in changes]
    for v in range(1, args.versions + 1):  # the plain scatter, in this process, before vLLM competes for the cores
        scatter.append(_scatter_s(state, changes[v], sync=device != "cpu"))
    changed = [sum(int(i.numel()) for i, _ in ch.values()) for ch in changes]
    del state, changes
    trim()

    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=str(tmp / "ckpt"), dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0,
              gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.05), max_num_seqs=4,
              tensor_parallel_size=tp, **ENGINE_KWARGS)
    load_s = time.perf_counter() - t0
    mem0 = _memory(llm)
    t0 = time.perf_counter()
    attach(llm, str(tmp / "store"), "bench", version=0, verify=False, prefetch=False)  # timings undisturbed
    attach_s = time.perf_counter() - t0
    mem1 = _memory(llm)
    rows = []
    for v in range(1, args.versions + 1):  # deltarl alone first: its memory is measured before the others run
        t0 = time.perf_counter()
        st = update(llm, v)
        wall = time.perf_counter() - t0
        mem = _memory(llm)
        ranks = status(llm)
        rows.append({"version": v, "changed": changed[v], "fetch_s": st["fetch_s"], "decode_s": st["decode_s"],
                     "pause_s": max(r["pause_s"] for r in ranks), "update_wall_s": wall, "scatter_s": scatter[v],
                     "delta_bytes": delta_bytes[v],
                     # per rank: bytes read for this version (TP 1: the whole delta) and fetch + decode + stage
                     "rank_fetched_bytes": [r.get("fetched_bytes") or delta_bytes[v] for r in ranks],
                     "rank_stage_s": [r["fetch_s"] for r in ranks],
                     # where a rank's stage went (a rank staging regions): read + verify, decode wall, decode CPU
                     "rank_stage_parts": [r.get("stage_parts") for r in ranks],
                     "worker_rss_after": mem["VmRSS"], "worker_peak_rss_after": mem["VmHWM"]})
        print(f"v{v}: fetch {st['fetch_s'] * 1e3:.0f} ms, decode {st['decode_s'] * 1e3:.0f} ms, pause {st['pause_s'] * 1e3:.1f} ms, "
              f"scatter {scatter[v] * 1e3:.1f} ms" + "".join(
                  f"; rank {i}: read {p['read_s'] * 1e3:.0f} ms, decode {p['decode_s'] * 1e3:.0f} ms "
                  f"(CPU {p['decode_cpu_s'] * 1e3:.0f} ms)" for i, p in enumerate(rows[-1]["rank_stage_parts"]) if p), flush=True)
    final = status(llm, digest=True)[0]
    mem_deltarl = _memory(llm)
    whole_model_paths = tp == 1 and not moe  # vLLM's sparse path and the dense reload read the model whole
    # the plain scatter in the worker, on the cores vLLM gives it (the fair floor of the pause; the
    # driver's scatter above runs on every core of the host)
    in_worker = llm.collective_rpc(vllm_runs.worker_scatter, args=(str(tmp / f"changes-{args.versions}.pt"),))[0] if tp == 1 else None
    parts = None
    if whole_model_paths:  # the pause taken apart in the worker, beside its index_copy_ on the same thread
        from benchmarks._pause_parts import worker_commit_parts

        parts = llm.collective_rpc(worker_commit_parts, args=(str(tmp / f"changes-{args.versions}.pt"),
                                                              str(tmp / "old-last.pt"), args.versions))[0]
        print("pause parts in the worker (median s): " + ", ".join(
            f"{k} {v * 1e3:.1f} ms" for k, v in parts.items() if isinstance(v, float)), flush=True)
    for row in rows if whole_model_paths else []:  # vLLM's own paths on the same engine, the same changes (they rewrite values already there)
        v = row["version"]
        row["vllm_sparse_s"] = llm.collective_rpc(vllm_runs.worker_vllm_sparse, args=(str(tmp / f"changes-{v}.pt"),))[0]
        print(f"v{v}: vLLM sparse {row['vllm_sparse_s'] * 1e3:.0f} ms", flush=True)
    dense = llm.collective_rpc(vllm_runs.worker_dense_reload)[0] if whole_model_paths else float("nan")
    print(f"dense load_weights {dense * 1e3:.0f} ms", flush=True)
    mem2 = _memory(llm)
    vllm_runs.shut_engine(llm)
    keys = ("fetch_s", "decode_s", "pause_s", "scatter_s", *(("vllm_sparse_s",) if whole_model_paths else ()))
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    med["vllm_sparse_s"] = med.get("vllm_sparse_s", float("nan"))
    med["dense_reload_s"] = dense
    med["rank_stage_s"] = statistics.median(max(r["rank_stage_s"]) for r in rows)
    med["worker_scatter_s"] = in_worker["scatter_s"] if in_worker else float("nan")
    med["rank_fetched_over_delta"] = statistics.median(max(r["rank_fetched_bytes"]) / r["delta_bytes"] for r in rows)
    med["rank_stage_parts"] = [  # per rank: the median of each part over the versions
        {k: statistics.median(r["rank_stage_parts"][i][k] for r in rows) for k in ("read_s", "decode_s", "decode_cpu_s")}
        if all(r["rank_stage_parts"][i] for r in rows) else None for i in range(len(rows[0]["rank_stage_parts"]))]
    res = {
        "shape": args.shape, "tp": tp, "model_bytes": model_bytes, "fraction": args.fraction, "versions": rows,
        "engine_load_s": load_s, "attach_s": attach_s, "median": med,
        "pause_over_scatter": med["pause_s"] / med["scatter_s"],
        "pause_over_worker_scatter": med["pause_s"] / med["worker_scatter_s"], "worker_cpus": in_worker, "pause_over_vllm_sparse": med["pause_s"] / med["vllm_sparse_s"],
        "worker_rss_vllm": mem0["VmRSS"], "worker_rss_attached": mem1["VmRSS"], "worker_rss_deltarl": mem_deltarl["VmRSS"],
        "worker_peak_rss_vllm": mem0["VmHWM"], "worker_peak_rss_deltarl": mem_deltarl["VmHWM"],
        "worker_rss_end": mem2["VmRSS"], "worker_peak_rss_end": mem2["VmHWM"],
        # deltarl's own: resident beyond vLLM's after its attach and updates, before vLLM's paths run
        # in copies of a rank's part of the model (model_bytes / tp), the largest over the ranks
        "extra_copies_steady": (max(r["worker_rss_after"] for r in rows) - mem0["VmRSS"]) / (model_bytes / tp),
        "extra_copies_peak": max(0, mem_deltarl["VmHWM"] - max(mem0["VmHWM"], mem0["VmRSS"])) / (model_bytes / tp),
        # vLLM's sparse path and the dense reload (with its own clone of the state) on top
        "extra_copies_peak_all_paths": max(0, mem2["VmHWM"] - mem0["VmHWM"]) / (model_bytes / tp),
        "pause_parts": parts, "rpc_bytes_per_update": _rpc_bytes(args.versions), "final_version": final["version"],
        "note": "2 shared cores; pause = the worker's finish_weight_update commit (prefetch off, so fetch/decode "
                "are timed alone); memory from the worker's /proc/self/status (VmRSS, VmHWM)",
    }
    return res


def _table(res: dict[str, Any], fraction: float, versions: int) -> None:
    m = res["median"]
    print(f"\nvLLM CPU, Qwen3-{res['shape']} shapes ({res['model_bytes'] / 1e9:.2f} GB BF16), TP {res['tp']}, "
          f"{fraction:.1%} changed, medians of {versions} versions")
    print(f"{'what':40s} {'ms':>10s}")
    for label, key in (("fetch + decode + stage, slowest rank", "rank_stage_s"), ("deltarl pause (commit)", "pause_s"),
                       ("plain torch index_copy_ (driver, all cores)", "scatter_s"),
                       ("plain torch index_copy_ (in the worker)", "worker_scatter_s"),
                       ("vLLM load_checkpoint_weight_patches", "vllm_sparse_s"), ("dense load_weights", "dense_reload_s")):
        print(f"{label:40s} {m[key] * 1e3:10.1f}")
    print(f"bytes a rank fetched / the version's delta bytes: {m['rank_fetched_over_delta']:.3f}")
    for i, p in enumerate(m["rank_stage_parts"]):
        if p:
            print(f"rank {i} stage (medians): read + verify {p['read_s'] * 1e3:.0f} ms, decode + stage "
                  f"{p['decode_s'] * 1e3:.0f} ms wall, {p['decode_cpu_s'] * 1e3:.0f} ms CPU of its thread")
    print(f"pause / plain scatter in the worker: {res['pause_over_worker_scatter']:.2f}x (worker: {res['worker_cpus']}), "
          f"in the driver: {res['pause_over_scatter']:.2f}x   pause / vLLM sparse: {res['pause_over_vllm_sparse']:.3f}x")
    print(f"worker memory beyond vLLM's own: {res['extra_copies_steady']:.3f} copies of a rank's part (steady), peak "
          f"{res['extra_copies_peak']:.3f} (with vLLM's sparse path and the dense reload: {res['extra_copies_peak_all_paths']:.3f})")
    print(f"RPC per update: {res['rpc_bytes_per_update']} B")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (vLLM's CPU build: one core a rank)")
    ap.add_argument("--compare-tp1", action="store_true", help="also run TP 1 on the same shape: per-rank ratios")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--quick", action="store_true", help="a smoke run: the tiny shape, one version, nothing written")
    ap.add_argument("--workdir", default=None, help="where the checkpoint and the store go (default: the temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="default: results/vllm_update.json (TP 1 dense), "
                                                          "results/vllm_update_parallel.json (TP > 1 or MoE)")
    args = ap.parse_args(argv)
    if args.quick:
        args.versions = 1
        args.shape = "moe-tiny" if args.shape.startswith("moe") else "tiny"
    res = run(args)
    _table(res, args.fraction, args.versions)
    if args.compare_tp1 and args.tp > 1:
        base = run(argparse.Namespace(**{**vars(args), "tp": 1}))
        _table(base, args.fraction, args.versions)
        res["tp1"] = base
        res["rank_stage_over_tp1"] = res["median"]["rank_stage_s"] / base["median"]["rank_stage_s"]
        print(f"\nTP {args.tp} / TP 1: bytes a rank fetched {res['median']['rank_fetched_over_delta']:.3f}x the delta "
              f"(target <= 0.65), fetch + decode + stage per rank {res['rank_stage_over_tp1']:.3f}x (target <= 0.65)")
    if args.quick:
        return
    out = args.out or (RESULTS if args.tp == 1 and not args.shape.startswith("moe") else RESULTS.with_name("vllm_update_parallel.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
