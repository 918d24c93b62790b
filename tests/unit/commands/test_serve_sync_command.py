"""``deltarl serve-sync``'s refusals, before any server is touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltarl.cli import main


def test_a_missing_store_is_an_error_not_an_empty_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve-sync", "r", "--server", "http://127.0.0.1:9", "--store", str(tmp_path / "typo")])
    assert code == 1
    assert "no store at" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()


def test_a_server_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve-sync", "r", "--store", "."])
    assert "--server" in capsys.readouterr().err
