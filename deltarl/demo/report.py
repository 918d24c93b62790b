"""The demo's PNG report (matplotlib): reward, changed fraction, bytes per step, actor shares, staging times."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from deltarl.demo.view import StepRow, regime_line


def write_report(rows: Sequence[StepRow], actors: Sequence[str], path: str | Path, *, title: str) -> Path:
    """Draw the run's per-step numbers into one PNG at ``path`` and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r.step)
    steps = [r.step for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    fig.suptitle(f"{title}\n{regime_line(list(rows))}", fontsize=11)

    ax = axes[0][0]
    ax.plot(steps, [r.reward for r in rows], marker="o")
    ax.set(title="mean reward", xlabel="step", ylim=(0, 1))
    ax.grid(alpha=0.3)

    ax = axes[0][1]
    ax.plot(steps, [100 * r.changed_fraction for r in rows], marker="o", color="tab:orange", label="changed elements")
    ax.plot(steps, [100 * r.delta_bytes / r.full_bytes if r.full_bytes else 0.0 for r in rows], marker=".",
            color="tab:green", label="delta bytes / full BF16 bytes")
    ax.set(title="per version (% of the model)", xlabel="step", ylim=(0, None))
    ax.grid(alpha=0.3)
    ax.legend()

    ax = axes[0][2]
    ax.bar(steps, [r.full_bytes / 1024 for r in rows], color="lightgray", label="full BF16")
    aurora = [(r.step, r.aurora_bytes / 1024) for r in rows if r.aurora_bytes is not None]
    if aurora:
        ax.bar([a[0] for a in aurora], [a[1] for a in aurora], color="tab:red", width=0.8, label="aurora (LEB128)")
    ax.bar(steps, [r.delta_bytes / 1024 for r in rows], color="tab:green", width=0.5, label="deltarl (shipped)")
    ax.set(title="bytes per version (KiB, log scale)", xlabel="step", yscale="log")
    ax.legend()

    ax = axes[1][0]
    bottom = [0.0] * len(rows)
    for actor in actors:
        share = [100 * r.shares().get(actor, 0.0) for r in rows]
        ax.bar(steps, share, bottom=bottom, label=actor)
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax.set(title="share of each step's prompts (%)", xlabel="step", ylim=(0, 100))
    ax.legend(loc="lower right")

    for ax, field, title in ((axes[1][1], "staged_s", "publish → staged per actor (s)"),
                             (axes[1][2], "commit_ms", "commit pause per actor (ms)")):
        for actor in actors:
            pts = [(r.version, getattr(r, field)[actor]) for r in rows if actor in getattr(r, field)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=actor)
        ax.set(title=title, xlabel="version")
        ax.grid(alpha=0.3)
        ax.legend()

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
