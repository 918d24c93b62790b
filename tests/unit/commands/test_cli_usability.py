"""What users trip on at the command line: --version, -v anywhere, --store help, a missing torch, piped inspect."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deltarl import __version__
from deltarl.cli import build_parser, main

STORE_COMMANDS = ("replay", "inspect", "audit", "gc", "actor", "trainer", "coordinator", "demo")


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"deltarl {__version__}"


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        (["inspect", "r"], 0),
        (["-v", "inspect", "r"], 1),
        (["inspect", "r", "-v"], 1),
        (["inspect", "-vv", "r"], 2),
        (["-v", "inspect", "r", "-v"], 2),
    ],
)
def test_verbose_before_or_after_the_command(argv: list[str], level: int) -> None:
    args = build_parser().parse_args(argv)
    assert args.verbose + args.sub_verbose == level


@pytest.mark.parametrize("command", STORE_COMMANDS)
def test_store_help_lists_every_scheme_and_the_endpoint_variable(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps help lines
    for scheme in ("path", "file://", "memory://", "s3://", "http(s)://", "fsspec", "gcs://", "$DELTARL_S3_ENDPOINT"):
        assert scheme in text, f"{command} --store help lacks {scheme}"


# torch and transformers made unimportable, as in the base Docker image
NO_TORCH = (
    "import sys\n"
    "for m in ('torch', 'transformers', 'safetensors.torch'): sys.modules[m] = None\n"
    "from deltarl.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "r", "--out", "x.safetensors"],
        ["demo", "--steps", "1"],
        ["trainer", "--config", "missing.yaml"],
        ["actor", "--run", "r"],
    ],
)
def test_a_command_without_torch_says_how_to_install_it(argv: list[str], tmp_path) -> None:
    out = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip() == f"deltarl {argv[0]}: needs torch and transformers, which this install lacks: pip install 'deltarl[torch]'"


def test_a_torch_import_deep_in_a_command_is_one_line_too(tmp_path) -> None:
    # the catch in main() covers commands without their own check (and imports inside them)
    code = NO_TORCH.replace(
        "from deltarl.cli import main\n",
        "from deltarl.cli import main\nimport deltarl.commands.gc as gc\n"
        "def boom(args):\n    import torch\ngc.run = boom\n",
    )
    out = subprocess.run([sys.executable, "-c", code, "gc", "r"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert (out.returncode, "Traceback" in out.stderr) == (2, False)
    assert "pip install 'deltarl[torch]'" in out.stderr


def test_inspect_piped_prints_whole_columns(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    from deltarl.pipeline.publisher import Publisher
    from deltarl.storage.open import open_store

    store = open_store(str(tmp_path))
    state = {"layer.with.a.rather.long.name.weight": torch.zeros(4096, dtype=torch.bfloat16)}
    ids = []
    with Publisher(store, "run-a", keyframe_interval=2) as pub:
        for step in range(3):
            state = {k: v.clone() for k, v in state.items()}
            state["layer.with.a.rather.long.name.weight"][: 100 * (step + 1)] += 1
            ids.append(pub.publish(state, step).version_id)
    assert main(["inspect", "run-a", "--store", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# run run-a: 1 tensors")
    header = lines[1].split("\t")
    assert header == ["version", "step", "kind", "segs", "changed", "delta", "ratio_vs_full", "keyframe", "digest", "id"]
    rows = [line.split("\t") for line in lines[2:]]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert all(len(r) == len(header) for r in rows)
    assert [r[-1] for r in rows] == [i[:12] for i in ids]  # ids whole, not cut to fit a terminal
    assert [r[2] for r in rows] == ["keyframe", "delta", "keyframe"]
    assert rows[1][4] == f"{100 * 200 / 4096:.3f}%"


def test_metric_flags_reach_the_configs(tmp_path) -> None:
    from deltarl.actor.config import ActorConfig
    from deltarl.commands.trainer import sink_overrides
    from deltarl.trainer.config import TrainerConfig

    parser = build_parser()
    args = parser.parse_args(["actor", "--run", "r", "--metrics-port", "9401", "--metrics-host", "127.0.0.1"])
    cfg = ActorConfig.load(None, metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    assert (cfg.metrics_port, cfg.metrics_host) == (9401, "127.0.0.1")
    for command in ("trainer", "demo"):
        extra = ["--config", "x.yaml"] if command == "trainer" else []
        args = parser.parse_args([command, *extra, "--metrics-port", "9400", "--tensorboard", "tb", "--wandb", "proj",
                                  "--wandb-mode", "offline"])
        assert sink_overrides(args) == {"metrics_port": 9400, "tensorboard": "tb", "wandb_project": "proj",
                                        "wandb_mode": "offline"}
    path = tmp_path / "trainer.yaml"
    path.write_text("run: r\nmetrics: {tensorboard: runs/tb, metrics_port: 9400}\n")
    loaded = TrainerConfig.load(str(path))
    assert (loaded.metrics.tensorboard, loaded.metrics.metrics_port) == ("runs/tb", 9400)
