"""The ``--full-size`` entry of ``benchmarks.e2e``: settings from the flags, the parts in order, the
JSON written after each part (a part's section replaced, the others kept), the docs' tables."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from . import fullreport
from .fullsize import Setting, ensure_trace, part_events, part_main, part_sweep, tokens_per_dollar

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "e2e-full.json"
EMULATION = ("tbf-shaped veth per region into a network namespace (rate, kernel) + EmulatedLink in its own process "
             "(delay RTT/2 each way, per-connection window); deltarl relay processes; one process per actor")  # fmt: skip


def _write_docs(doc: dict[str, Any], docs: Path) -> list[Path]:
    out = []
    png = fullreport.plot_sweep(doc, docs / "e2e-regions.png")
    if png is not None:
        out.append(png)
    md = docs / "e2e.md"
    begin, end = "<!-- e2e-full-table:begin -->", "<!-- e2e-full-table:end -->"
    if md.exists() and begin in md.read_text():
        parts = [fullreport.main_table(doc), "", fullreport.cpu_table(doc), "", fullreport.sweep_table(doc), "",
                 fullreport.tokens_table(doc), "",
                 *(f"Command ({part}): `{c['command']}`  " for part, c in doc.get("commands", {}).items())]  # fmt: skip
        text = md.read_text()
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1] if end in rest else ""
        md.write_text(head + begin + "\n" + "\n".join(parts) + "\n" + end + tail)
        out.append(md)
    return out


def rerender_full(path: Path, docs: Path | None) -> int:
    """Recompute the derived figures (tokens per dollar) of a saved result and rewrite its docs."""
    doc = json.loads(path.read_text())
    if "rates" in doc:
        doc["tokens_per_dollar"] = tokens_per_dollar(doc["rates"], doc["scale"]["T"])
    path.write_text(json.dumps(doc, indent=1))
    for out in _write_docs(doc, docs if docs is not None else REPO / "docs"):
        print(f"wrote {out}")
    return 0


def run_full_size(args: argparse.Namespace, argv: list[str]) -> int:
    from rich.console import Console

    console = Console(width=160)
    out: Path = args.out if args.out.name != "e2e.json" else RESULTS
    st = Setting(
        model=args.model, regions=args.regions or 2, T=args.time_scale or 1.0, rtt_s=args.rtt_ms / 1e3,
        window_bytes=int((args.window_mib or 2.0) * (1 << 20)), gen_s=args.gen_s, train_s=args.train_s, lag=args.lag,
        steps=args.steps or 3, full_steps=args.full_steps,
    )  # fmt: skip
    parts = [p for p in args.parts.split(",") if p]
    rates = [float(r) for r in args.rates.split(",")]
    modes = [m for m in args.modes.split(",") if m and m != "ideal"]
    scratch = args.scratch or Path(tempfile.gettempdir()) / "deltarl-e2e-full"
    doc: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if doc.get("benchmark") != "e2e-full":
        doc = {"benchmark": "e2e-full"}
    command = " ".join(["python", "-m", "benchmarks.e2e", *argv])
    doc.update(quick=False, cpus=os.cpu_count(), lag=st.lag, streams=st.streams, range_bytes=st.range_bytes, emulation=EMULATION)
    doc.setdefault("commands", {})

    def log(msg: str) -> None:
        console.print(f"[{time.strftime('%H:%M:%S')}] {msg}")

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
        log(f"wrote {out}")

    runs = scratch / "runs"
    for part in parts:
        shutil.rmtree(runs, ignore_errors=True)
        t0 = time.monotonic()
        if part == "main":
            trace = ensure_trace(scratch, st.model, max(st.steps, st.full_steps))
            log(f"main: Qwen3-{st.model} at {', '.join(f'{r:g}' for r in rates)} Gbit/s, {st.regions} regions, T = {st.T:g}")
            doc["scale"] = {"S": 1.0, "T": st.T, "model": st.model, "params": st.copy_bytes // 2, "copy_bytes": st.copy_bytes,
                            "rtt_s": st.rtt_s, "window_bytes": st.window_bytes, "gen_s": st.gen_s, "train_s": st.train_s,
                            "setting": asdict(st), "command": command, "emulation": EMULATION}  # fmt: skip
            doc["regions"] = st.regions
            doc["steps"], doc["full_steps"] = st.steps, st.full_steps

            def on_mode(rate: str, mode: str, res: dict[str, Any]) -> None:  # every measured mode saved at once
                doc.setdefault("partial", {}).setdefault(rate, {})[mode] = res
                save()

            doc["rates"] = asyncio.run(part_main(st, rates, trace, runs, modes, log, on_mode))
            doc.pop("partial", None)
            doc["tokens_per_dollar"] = tokens_per_dollar(doc["rates"], st.T)
        elif part == "events":
            es = replace(st, rate_gbps=rates[0], steps=max(st.steps, 4))
            trace = ensure_trace(scratch, st.model, es.steps)
            doc["events"] = asyncio.run(part_events(es, trace, runs, log))
        elif part == "sweep":
            ss = replace(st, model=args.sweep_model, rate_gbps=args.sweep_rate, T=args.sweep_time_scale or st.T, regions=1)
            trace = ensure_trace(scratch, ss.model, max(ss.steps, ss.full_steps))
            doc["sweep"] = asyncio.run(part_sweep(ss, [int(n) for n in args.sweep_regions.split(",")], trace, runs, log))
            doc["sweep_scale"] = {"T": ss.T, "model": ss.model, "params": ss.copy_bytes // 2, "setting": asdict(ss)}
        else:
            raise SystemExit(f"unknown part {part!r} (main, events, sweep)")
        doc["commands"][part] = {"command": command, "wall_s": time.monotonic() - t0, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
        doc["command"] = command
        save()
    shutil.rmtree(runs, ignore_errors=True)
    docs = args.docs if args.docs is not None else REPO / "docs"
    if args.docs is not None or st.model != "tiny":
        for path in _write_docs(doc, docs):
            log(f"wrote {path}")
    return 0
