"""The e2e result as a rich table, a markdown table (docs/e2e.md) and a bar chart (docs/e2e.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

COLUMNS = ("link", "mode", "step (scaled)", "step (full size)", "x ideal", "staged on all (full size)",
           "publish (full size)", "GPU idle", "per link per step (full size)", "exact")  # fmt: skip


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def rows(doc: dict[str, Any]) -> list[list[str]]:
    S, T = doc["scale"]["S"], doc["scale"]["T"]
    out = []
    for rate in doc["rates"].values():
        for mode, r in rate["modes"].items():
            link = sum(r["link_bytes_per_step"].values()) / max(1, len(r["link_bytes_per_step"]))
            ratio = rate.get(f"{mode}_ratio")
            exact = {None: "-", True: "yes", False: "NO"}[r["exact"]]
            out.append([
                f"{rate['rate_gbps']:g} Gbit/s", mode, f"{r['step_s']:.3f} s", f"{r['step_s'] * T:.1f} s",
                f"{ratio:.3f}" if ratio is not None else "-", f"{r['staged_s'] * T:.2f} s", f"{r['publish_s'] * T:.2f} s",
                f"{100 * r['idle_fraction']:.1f}%", _mb(link * S), exact,
            ])  # fmt: skip
    return out


def title(doc: dict[str, Any]) -> str:
    sc = doc["scale"]
    return (f"e2e: Qwen3-8B scaled to {sc['params'] / 1e6:.1f}M params (S={sc['S']:.1f}), time /{sc['T']:g}, "
            f"{doc['regions']} actor regions, RTT {sc['rtt_s'] * 1e3:.0f} ms, window {sc['window_bytes'] / 2**20:g} MiB/stream, "
            f"{doc['streams']} streams, gen {sc['gen_s']:g} s + train {sc['train_s']:g} s per step, lag {doc['lag']}")  # fmt: skip


def print_table(console: Console, doc: dict[str, Any]) -> None:
    table = Table(title=title(doc))
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("link", "mode") else "right")
    for r in rows(doc):
        table.add_row(*r)
    console.print(table)
    for rate in doc["rates"].values():
        t = rate["targets"]
        if "met" in t:
            verdict = "met" if t["met"] else "MISSED"
            line = f"  {rate['rate_gbps']:g} Gbit/s: deltarl {rate['deltarl_ratio']:.3f}x ideal (target <= {t['deltarl_ratio_max']}: {verdict})"
            if "full_ratio" in rate:
                line += f"; full {rate['full_ratio']:.2f}x measured, {rate['full_nominal_ratio']:.2f}x at the nominal link rate"
            console.print(line)


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"| {' | '.join(COLUMNS)} |", "|" + "---|" * len(COLUMNS)]
    lines += [f"| {' | '.join(r)} |" for r in rows(doc)]
    lines.append("")
    for rate in doc["rates"].values():
        full = rate["modes"].get("full", {})
        if "full_nominal_ratio" in rate:
            lines.append(f"* {rate['rate_gbps']:g} Gbit/s: full broadcast measured {full['step_s'] * doc['scale']['T']:.0f} s per step; "
                         f"at the nominal link rate the same loop takes {rate['full_nominal_step_s'] * doc['scale']['T']:.0f} s "
                         f"({rate['full_nominal_ratio']:.2f}x ideal).")  # fmt: skip
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = doc["scale"]["T"]
    rates = list(doc["rates"].values())
    modes = list(rates[0]["modes"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(modes)
    colors = {"ideal": "#9e9e9e", "full": "#d62728", "deltarl": "#1f77b4"}
    for i, mode in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(rates))]
        ys = [r["modes"][mode]["step_s"] * T for r in rates]
        bars = ax.bar(xs, ys, width, label=mode, color=colors.get(mode))
        if mode == "full":
            for x, r in zip(xs, rates, strict=True):
                if "full_nominal_step_s" in r:
                    y = r["full_nominal_step_s"] * T
                    ax.hlines(y, x - width / 2, x + width / 2, colors="black", linestyles="dashed")
                    ax.annotate(f"nominal-rate\nbound {r['full_nominal_ratio']:.2f}x", (x, y), xytext=(0, -3), textcoords="offset points",
                                ha="center", va="top", fontsize=7, color="white")  # fmt: skip
        for bar, r in zip(bars, rates, strict=True):
            ratio = r.get(f"{mode}_ratio")
            if ratio is not None:
                ax.annotate(f"{ratio:.3f}x" if ratio < 1.2 else f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(rates)), [f"{r['rate_gbps']:g} Gbit/s" for r in rates])
    ax.set_ylabel("step time, full-size equivalent (s)")
    ax.set_title("Qwen3-8B async RL step over WAN links (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_docs(doc: dict[str, Any], docs: Path) -> list[Path]:
    """Write ``e2e.png`` and the generated table into ``e2e.md`` (between marker lines if present)."""
    docs.mkdir(parents=True, exist_ok=True)
    png = docs / "e2e.png"
    plot(doc, png)
    md = docs / "e2e.md"
    begin, end = "<!-- e2e-table:begin -->", "<!-- e2e-table:end -->"
    block = f"{begin}\n{title(doc)}\n\n{markdown(doc)}\n\nCommand: `{doc['command']}`\n{end}"
    if md.exists() and begin in md.read_text():
        text = md.read_text()
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1] if end in rest else ""
        md.write_text(head + block + tail)
    else:
        md.write_text(f"# End-to-end benchmark\n\n{block}\n")
    return [md, png]
