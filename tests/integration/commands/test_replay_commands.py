"""The run commands end to end: ``deltarl replay``, ``inspect`` and ``gc`` on a local store."""

from __future__ import annotations

import json

import pytest

from deltarl.cli import main
from deltarl.pipeline import RunLayout
from deltarl.storage import LocalStore
from tests.fixtures.runs import publish_run, states_equal

pytestmark = pytest.mark.torch


@pytest.fixture
def run_dir(tmp_path):
    root = tmp_path / "runs"
    exports = publish_run(LocalStore(root), "demo", 8, keyframe_interval=4, digest_interval=2)
    return root, exports


def test_replay_command(run_dir, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    root, exports = run_dir
    out = tmp_path / "v5.safetensors"
    assert main(["replay", "demo", "--store", str(root), "--version", "5", "--out", str(out), "--verify"]) == 0
    assert states_equal(load_file(out), exports[5])
    with safe_open(out, "pt") as f:
        assert f.metadata()["version"] == "5"
    printed = capsys.readouterr().out
    assert "demo version 5" in printed
    from deltarl.codec import state_digest

    # keyframe 4 records the newest digest at or before 5: named, with the version it came from
    assert f":{state_digest(exports[4])} (version 4's (version 5 records none" in printed
    head = tmp_path / "head.safetensors"
    assert main(["replay", "demo", "--store", str(root), "--out", str(head)]) == 0
    assert states_equal(load_file(head), exports[-1])


def test_replay_command_reports_corruption(run_dir, tmp_path, capsys):
    root, _ = run_dir
    key = RunLayout("demo").segment(3, 0, epoch=1)
    path = root / key
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    out = tmp_path / "x.safetensors"
    assert main(["replay", "demo", "--store", str(root), "--version", "3", "--out", str(out)]) == 1
    assert key in capsys.readouterr().err
    assert not out.exists()


def test_inspect_command(run_dir, capsys):
    root, _ = run_dir
    assert main(["inspect", "demo", "--store", str(root)]) == 0
    text = capsys.readouterr().out
    assert "keyframe" in text
    assert "ratio" in text
    assert main(["inspect", "demo", "--store", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["head"] == 7
    assert [r["version"] for r in doc["versions"]] == list(range(8))
    assert [r["kind"] for r in doc["versions"]].count("keyframe") == 2
    assert all(0 < r["changed_fraction"] < 0.2 for r in doc["versions"][1:])
    assert main(["inspect", "demo", "--store", str(root), "--version", "3", "--json"]) == 0
    assert [r["version"] for r in json.loads(capsys.readouterr().out)["versions"]] == [3]
    assert main(["inspect", "nope", "--store", str(root)]) == 1


def test_gc_command(run_dir, capsys):
    root, _ = run_dir
    store = LocalStore(root)
    stray = RunLayout("demo").segment(2, 9, epoch=1)
    store.put(stray, b"junk")
    assert main(["gc", "demo", "--store", str(root), "--dry-run", "--keep-last", "2"]) == 0
    text = capsys.readouterr().out
    assert "would remove 1 orphans" in text
    assert "versions 0..3" in text
    assert store.exists(stray)
    assert main(["gc", "demo", "--store", str(root), "--keep-last", "2"]) == 0
    assert not store.exists(stray)
    assert not store.exists(RunLayout("demo").manifest(3))
    assert store.exists(RunLayout("demo").manifest(4))


def test_inspect_names_a_missing_middle_version(run_dir, capsys):
    root, _ = run_dir
    store = LocalStore(root)
    layout = RunLayout("demo")
    assert main(["gc", "demo", "--store", str(root), "--keep-last", "2"]) == 0  # removes versions 0..3
    capsys.readouterr()
    assert main(["inspect", "demo", "--store", str(root), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["missing"] == []  # what gc removed is no gap
    assert "missing" not in captured.err
    for key in list(store.list(layout.version_prefix(5))):  # a middle version is gone, manifest and all
        store.delete(key)
    assert main(["inspect", "demo", "--store", str(root)]) == 0
    captured = capsys.readouterr()
    assert "version 5 is missing" in captured.err
    rows = [line.split("\t") for line in captured.out.splitlines() if not line.startswith(("#", "version"))]
    assert [(r[0], r[2]) for r in rows] == [("4", "keyframe"), ("5", "missing"), ("6", "delta"), ("7", "delta")]
    assert main(["inspect", "demo", "--store", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["missing"] == [5]
    assert [r["version"] for r in doc["versions"]] == [4, 6, 7]
