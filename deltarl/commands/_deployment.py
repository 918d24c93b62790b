"""Sections of a deployment file (``examples/deployment.yaml``) for commands whose config is not a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from deltarl.errors import ConfigError


def load_section(path: str | Path, *names: str) -> dict[str, Any]:
    """``data[names[0]][names[1]]…`` of a YAML/JSON file, as a dict; ``ConfigError`` names what is missing."""
    try:
        text = Path(path).read_text()
        data: Any = yaml.safe_load(text) if str(path).endswith((".yaml", ".yml")) else json.loads(text)
    except (OSError, yaml.YAMLError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: {err}") from err
    where = str(path)
    for name in names:
        if not isinstance(data, dict) or not isinstance(data.get(name), dict):
            have = sorted(data) if isinstance(data, dict) else []
            raise ConfigError(f"{where}: no section {name!r} (have {have})")
        data, where = data[name], f"{where}:{name}"
    return dict(data)
