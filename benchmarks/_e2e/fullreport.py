"""The full-size result (``e2e-full.json``) as markdown tables and the regions plot (docs/e2e-regions.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _b(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def main_table(doc: dict[str, Any]) -> str:
    T = doc["scale"]["T"]
    lines = ["| link | mode | step | x ideal | staged on all | publish | GPU idle | per link per step | exact |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for rate in doc.get("rates", {}).values():
        for mode, r in rate["modes"].items():
            per = r["link_bytes_per_step"]
            link = sum(per.values()) / max(1, len(per))
            exact = {None: "-", True: "yes", False: "NO"}[r["exact"]]
            lines.append(f"| {rate['rate_gbps']:g} Gbit/s | {mode} | {r['step_s'] * T:.1f} s | {rate[f'{mode}_ratio']:.3f} | "
                         f"{r['staged_s'] * T:.2f} s | {r['publish_s'] * T:.2f} s | {100 * r['idle_fraction']:.1f}% | {_b(link)} | {exact} |")  # fmt: skip
    return "\n".join(lines)


def cpu_table(doc: dict[str, Any]) -> str:
    lines = ["| link | mode | CPU s per version, by process | peak RSS, model copies, by process |", "|---|---|---|---|"]
    for rate in doc.get("rates", {}).values():
        for mode, r in rate["modes"].items():
            if "cpu_s_per_version" not in r:
                continue
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_s_per_version"].items())
            rss = ", ".join(f"{k} {v:.2f}" for k, v in r["peak_rss_copies"].items())
            lines.append(f"| {rate['rate_gbps']:g} Gbit/s | {mode} | {cpu} | {rss} |")
    return "\n".join(lines)


def sweep_nominal(doc: dict[str, Any], p: dict[str, Any]) -> float:
    """Full broadcast's step at the nominal link rate for one sweep point, over the ideal (the loop
    of ``driver.py`` with the measured publish time and bytes per link)."""
    st = doc["sweep_scale"]["setting"]
    T = st["T"]
    gen, train, rate = st["gen_s"] / T, st["train_s"] / T, st["rate_gbps"] * 1e9 * T
    per = p["full"]["link_bytes_per_step"]
    transfer = sum(per.values()) / len(per) * 8 / rate
    x = train + p["full"]["publish_s"] + transfer
    step = max(gen, (x + gen) / (st["lag"] + 1), transfer)
    return step / doc["sweep"]["ideal_step_s"]


def sweep_table(doc: dict[str, Any]) -> str:
    sw = doc.get("sweep")
    if not sw:
        return ""
    T = doc["sweep_scale"]["T"]
    lines = [f"Qwen3-{sw['model'].upper()} at {sw['rate_gbps']:g} Gbit/s per region, ideal {sw['ideal_step_s'] * T:.1f} s:", "",
             "| regions | full | x ideal | x ideal at the nominal link rate | deltarl | x ideal | staged on all, deltarl | exact (full, deltarl) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in sw["points"]:
        lines.append(f"| {p['regions']} | {p['full']['step_s'] * T:.1f} s | {p['full_ratio']:.3f} | {sweep_nominal(doc, p):.3f} | "
                     f"{p['deltarl']['step_s'] * T:.1f} s | {p['deltarl_ratio']:.3f} | {p['deltarl']['staged_s'] * T:.2f} s | "
                     f"{p['full']['exact']}, {p['deltarl']['exact']} |")  # fmt: skip
    return "\n".join(lines)


def tokens_table(doc: dict[str, Any]) -> str:
    tp = doc.get("tokens_per_dollar")
    if not tp:
        return ""
    lines = [f"Tokens per dollar at {tp['per_tokens_per_s']:,} tokens/s of generation (8xH100; every figure scales with it):", "",
             "| link | RDMA ideal (8xH100 $55.04/h +26% fabric) | deltarl, Ethernet ($55.04/h) | x RDMA | full broadcast, Ethernet | x RDMA |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for key, e in tp["rates"].items():
        full = f"{e['full_ethernet'] / 1e3:.0f} k | {e['full_vs_rdma']:.2f}" if "full_ethernet" in e else "- | -"
        lines.append(f"| {key.replace('gbps', ' Gbit/s')} | {e['rdma_ideal'] / 1e3:.0f} k | {e['deltarl_ethernet'] / 1e3:.0f} k | "
                     f"{e['deltarl_vs_rdma']:.2f} | {full} |")  # fmt: skip
    return "\n".join(lines)


def plot_sweep(doc: dict[str, Any], path: Path) -> Path | None:
    sw = doc.get("sweep")
    if not sw:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["regions"] for p in sw["points"]]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(xs, [p["full_ratio"] for p in sw["points"]], "o-", color="#d62728", label="full BF16 broadcast (relays, multi-stream)")
    ax.plot(xs, [sweep_nominal(doc, p) for p in sw["points"]], "x--", color="#d62728", alpha=0.6,
            label="full broadcast at the nominal link rate (bound)")
    ax.plot(xs, [p["deltarl_ratio"] for p in sw["points"]], "o-", color="#1f77b4", label="deltarl")
    ax.axhline(1.0, color="#9e9e9e", linestyle="--", label="ideal (one RDMA cluster)")
    ax.set_xticks(xs)
    ax.set_xlabel("actor regions (one relay and one actor each)")
    ax.set_ylabel("step time / ideal")
    ax.set_ylim(bottom=0.9)
    T = doc["sweep_scale"]["T"]
    ax.set_title(f"Qwen3-{sw['model'].upper()}, real bytes, time / {T:g}, {sw['rate_gbps']:g} Gbit/s per region, 50 ms RTT", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
