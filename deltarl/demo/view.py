"""The demo's live per-step table (rich), fed by the trainer's step reports and the actors' events.

Publish-to-staged times arrive after a step's row is first shown (actors stage version ``v`` while
the next step runs), so rows are re-rendered as events come in. Without a terminal the view prints
one plain line per step instead.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from deltarl.pipeline.inspection import human_bytes


@dataclass
class StepRow:
    """One training step: what the trainer published and what every actor did with it."""

    step: int
    version: int
    reward: float
    changed_fraction: float
    delta_bytes: int
    full_bytes: int
    wait_s: float
    publish_s: float
    #: actor name -> seconds from the manifest's creation to staged on that actor (version ``version``)
    staged_s: dict[str, float] = field(default_factory=dict)
    #: actor name -> commit pause in milliseconds (version ``version``)
    commit_ms: dict[str, float] = field(default_factory=dict)
    #: actor name -> prompts of this step admitted from it
    prompts: dict[str, int] = field(default_factory=dict)
    #: BF16 elements that differ from the version before
    changed_elements: int = 0
    #: bytes the seed's ``aurora`` codec (LEB128 gaps, raw values) takes for the same delta (None: not counted)
    aurora_bytes: int | None = None

    def shares(self) -> dict[str, float]:
        total = sum(self.prompts.values())
        return {a: n / total for a, n in self.prompts.items()} if total else {}


def regime_line(rows: list[StepRow]) -> str:
    """``rows`` in one line: mean changed fraction per version, deltas and aurora's bytes vs full BF16."""
    if not rows:
        return ""
    changed = sum(r.changed_fraction for r in rows) / len(rows)
    full = sum(r.full_bytes for r in rows) or 1
    delta = sum(r.delta_bytes for r in rows)
    line = (f"{len(rows)} versions: {changed:.2%} of BF16 elements changed per version on average; "
            f"deltas {human_bytes(delta)} = {delta / full:.2%} of full BF16 ({human_bytes(full)})")
    counted = [r for r in rows if r.aurora_bytes is not None]
    if counted:
        aurora = sum(r.aurora_bytes or 0 for r in counted)
        mine = sum(r.delta_bytes for r in counted) or 1
        line += f"; aurora (LEB128) would ship {human_bytes(aurora)} = {aurora / mine:.2f}x deltarl's bytes"
    return line


class DemoView:
    """Holds the rows and renders them; thread-safe (rows come from the trainer and a poller)."""

    def __init__(self, actors: list[str], *, title: str, console: Console | None = None) -> None:
        self.actors = actors
        self.title = title
        self.console = console or Console()
        self.rows: dict[int, StepRow] = {}
        self.status = ""
        self._lock = threading.Lock()
        self._live: Live | None = None
        self._printed: set[int] = set()

    # --- updates -------------------------------------------------------------------------------

    def add_step(self, row: StepRow) -> None:
        with self._lock:
            self.rows[row.step] = row
        if self._live is None:
            self._print_line(row)
        self.refresh()

    def set_staged(self, version: int, actor: str, seconds: float, commit_ms: float | None = None) -> None:
        with self._lock:
            row = next((r for r in self.rows.values() if r.version == version), None)
            if row is not None:
                row.staged_s[actor] = seconds
                if commit_ms is not None:
                    row.commit_ms[actor] = commit_ms

    def set_status(self, text: str) -> None:
        self.status = text
        self.refresh()

    def refresh(self) -> None:
        if self._live is not None:
            self._live.update(self.render())

    # --- rendering -------------------------------------------------------------------------------

    def regime(self) -> str:
        """The run so far in one line: changed fraction per version, deltas (and aurora's) vs full BF16."""
        with self._lock:
            rows = list(self.rows.values())
        return regime_line(rows)

    def render(self) -> Table:
        caption = "\n".join(x for x in (self.regime(), self.status) if x)
        table = Table(title=self.title, caption=caption or None, expand=False)
        table.add_column("step", justify="right")
        table.add_column("ver", justify="right")
        table.add_column("reward", justify="right")
        table.add_column("changed", justify="right")
        table.add_column("delta / full BF16", justify="right")
        table.add_column("aurora", justify="right")
        table.add_column("publish", justify="right")
        table.add_column("publish→staged per actor (s)", justify="left")
        table.add_column("commit (ms)", justify="right")
        table.add_column("prompt share " + "/".join(self.actors), justify="left")
        with self._lock:
            rows = [self.rows[k] for k in sorted(self.rows)][-30:]
            for r in rows:
                table.add_row(*self._cells(r))
        return table

    def _cells(self, r: StepRow) -> list[str]:
        ratio = r.delta_bytes / r.full_bytes if r.full_bytes else 0.0
        aurora = human_bytes(r.aurora_bytes) if r.aurora_bytes is not None else "-"
        staged = " ".join(f"{r.staged_s[a]:.2f}" if a in r.staged_s else "  … " for a in self.actors)
        pauses = list(r.commit_ms.values())
        pause = f"{max(pauses):.1f}" if pauses else "…"
        shares = r.shares()
        share = " ".join(f"{shares.get(a, 0.0):4.0%}" for a in self.actors)
        reward_color = "green" if r.reward >= 0.5 else "yellow" if r.reward >= 0.2 else "red"
        return [
            str(r.step),
            str(r.version),
            f"[{reward_color}]{r.reward:.3f}[/{reward_color}]",
            f"{r.changed_fraction:6.2%}",
            f"{human_bytes(r.delta_bytes)} / {human_bytes(r.full_bytes)} ({ratio:.1%})",
            aurora,
            f"{r.publish_s:.2f}s",
            staged,
            pause,
            share,
        ]

    def _print_line(self, r: StepRow) -> None:
        if r.step in self._printed:
            return
        self._printed.add(r.step)
        ratio = r.delta_bytes / r.full_bytes if r.full_bytes else 0.0
        shares = r.shares()
        aurora = f" (aurora {human_bytes(r.aurora_bytes)})" if r.aurora_bytes is not None else ""
        self.console.print(
            f"step {r.step:3d}  version {r.version:3d}  reward {r.reward:.3f}  changed {r.changed_fraction:6.2%}  "
            f"delta {human_bytes(r.delta_bytes)} of {human_bytes(r.full_bytes)} ({ratio:.1%}){aurora}  "
            f"publish {r.publish_s:.2f}s  shares " + " ".join(f"{a}={shares.get(a, 0.0):.0%}" for a in self.actors),
            highlight=False,
            soft_wrap=True,
        )

    # --- lifetime --------------------------------------------------------------------------------

    def __enter__(self) -> DemoView:
        if self.console.is_terminal:
            self._live = Live(self.render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.__exit__(*exc)
            self._live = None
