"""The demo's PNG report (matplotlib): reward, changed fraction, bytes per step, actor shares, staging times."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from deltarl.demo.view import StepRow


def write_report(rows: Sequence[StepRow], actors: Sequence[str], path: str | Path, *, title: str) -> Path:
    """Draw the run's per-step numbers into one PNG at ``path`` and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r.step)
    steps = [r.step for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    fig.suptitle(title)

    ax = axes[0][0]
    ax.plot(steps, [r.reward for r in rows], marker="o")
    ax.set(title="mean reward", xlabel="step", ylim=(0, 1))
    ax.grid(alpha=0.3)

    ax = axes[0][1]
    ax.plot(steps, [100 * r.changed_fraction for r in rows], marker="o", color="tab:orange")
    ax.set(title="BF16 elements changed per version (%)", xlabel="step", ylim=(0, 100))
    ax.grid(alpha=0.3)

    ax = axes[0][2]
    ax.bar(steps, [r.full_bytes / 1024 for r in rows], color="lightgray", label="full BF16")
    ax.bar(steps, [r.delta_bytes / 1024 for r in rows], color="tab:green", label="delta shipped")
    ax.set(title="bytes per version (KiB)", xlabel="step")
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
