"""``deltarl audit``: check every stored rollout against the version chain, its lease and its step."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from deltarl.commands._store import add_store_argument

HELP = "audit a run's stored rollouts: version ids in the chain, valid leases, accepted versions (--rescore: logprobs)"


def _steps(text: str) -> tuple[int | None, int | None]:
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            n = int(lo)
            return n, n + 1
        return (int(lo) if lo else None), (int(hi) if hi else None)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--steps wants A:B (B exclusive), A: , :B or N, got {text!r}") from err


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_argument(parser)
    parser.add_argument("--steps", type=_steps, default=(None, None), metavar="A:B",
                        help="audit steps A (inclusive) to B (exclusive); either end may be omitted")
    parser.add_argument("--rescore", type=int, default=0, metavar="N",
                        help="recompute the sampled tokens' logprobs of N rollouts under the claimed version")
    parser.add_argument("--tolerance", type=float, default=0.05, metavar="T",
                        help="largest mean |logprob difference| per completion token a rescored sample may show "
                             "(default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rescore sample (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--require-rollouts", action="store_true",
                        help="fail (exit 1) when the run has no rollouts to audit (default: that is no failure)")


def run(args: argparse.Namespace) -> int:
    from deltarl.commands._store import open_existing_store
    from deltarl.coordinator.audit import audit_run
    from deltarl.errors import DeltaRLError
    from deltarl.trainer.rescore import RescoreFinding, rescore_rollouts

    try:
        store = open_existing_store(args.store)
    except DeltaRLError as err:
        print(f"deltarl audit: {err}", file=sys.stderr)
        return 2
    try:
        report = audit_run(store, args.run, args.steps)
        exists = report.versions_in_chain > 0 or report.steps_in_store > 0 or \
            next(iter(store.list(f"{args.run}/")), None) is not None
        rescored: list[RescoreFinding] = []
        if args.rescore > 0:
            results = [rec.result for rec in report.records]
            try:
                rescored = rescore_rollouts(store, args.run, results, args.rescore, tolerance=args.tolerance, seed=args.seed)
            except ImportError as err:  # torch and transformers are the optional [torch] extra
                print(f"deltarl audit: --rescore needs deltarl[torch] ({err})", file=sys.stderr)
                return 2
    except DeltaRLError as err:
        print(f"deltarl audit: {err}", file=sys.stderr)
        return 1
    finally:
        store.close()
    if not exists:
        print(f"deltarl audit: no run {args.run!r} in {args.store}", file=sys.stderr)
        return 1
    if report.steps_in_store == 0 and report.ok and not args.json:
        # The chain checked out and no step was ever opened (a run published without a coordinator):
        # nothing failed an audit. --require-rollouts makes that a failure for scripts that expect some.
        line = f"run {args.run!r}: no rollouts to audit ({report.versions_in_chain} versions in the chain checked)"
        if args.require_rollouts:
            print(f"deltarl audit: {line}", file=sys.stderr)
            return 1
        print(line)
        return 0
    flagged = [dataclasses.asdict(f) for f in rescored if not f.ok]
    if args.json:
        print(json.dumps({
            "run": report.run, "ok": report.ok and not flagged, "versions_in_chain": report.versions_in_chain,
            "steps": [dict(s.__dict__, versions=dict(s.versions)) for s in report.steps],
            "chain": report.chain,
            "failures": [f.__dict__ for f in report.failures],
            "rescored": len(rescored), "rescore_failed": len(flagged), "rescore_flagged": flagged,
        }, indent=1))
    else:
        _print_tables(report, len(rescored), flagged)
    if args.require_rollouts and report.steps_in_store == 0:
        return 1
    return 0 if report.ok and not flagged else 1


def _print_tables(report: Any, rescored: int, flagged: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"audit of run {report.run!r} ({report.versions_in_chain} versions in the chain)")
    for col in ("step", "state", "results", "prompts", "samples", "tokens", "versions", "failures"):
        table.add_column(col, justify="right" if col not in ("state", "versions") else "left")
    for s in report.steps:
        versions = ", ".join(f"{report.version_label(v)}×{n}" for v, n in s.versions.most_common(4))
        table.add_row(str(s.step), s.state, str(s.results), str(s.prompts), str(s.samples), str(s.tokens),
                      versions, f"[red]{s.failures}[/red]" if s.failures else "0")
    console.print(table)
    if report.failures:
        ft = Table(title=f"{len(report.failures)} failed checks")
        for col in ("step", "check", "object", "detail"):
            ft.add_column(col)
        for f in report.failures[:50]:
            ft.add_row("" if f.step is None else str(f.step), f.check, f.key.rsplit("/", 1)[-1], f.detail)
        console.print(ft)
    if rescored:
        console.print(f"rescored {rescored} samples: {len(flagged)} did not match within tolerance")
        if flagged:
            rt = Table(title="rescore: flagged samples")
            for col in ("step", "lease_id", "actor_id", "version", "prompt_id", "mean_abs_diff", "reason"):
                rt.add_column(col)
            for f in flagged[:50]:
                rt.add_row(*(str(f.get(c, "")) for c in ("step", "lease_id", "actor_id", "version", "prompt_id")),
                           f"{f.get('mean_abs_diff', float('nan')):.4g}", str(f.get("reason", "")))
            console.print(rt)
    verdict = "[green]OK[/green]" if report.ok and not flagged else "[red]FAILED[/red]"
    console.print(f"{sum(s.results for s in report.steps)} rollouts in {len(report.steps)} steps: {verdict}")
