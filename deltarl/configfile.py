"""Config files: one YAML or JSON mapping, or a deployment file with one section per process.

Every ``deltarl`` process with a config file reads it here, so they all agree on what a file may
hold: a ``.yaml``/``.yml`` file is YAML, anything else JSON; an empty file is ``{}``; the top level
must be a mapping. Every error (unreadable, unparsable, wrong shape, invalid fields) is a
:class:`~deltarl.errors.ConfigError` that names the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from deltarl.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML or JSON file (``{}`` for an empty file)."""
    try:
        text = Path(path).read_text()
        data: Any = yaml.safe_load(text) if str(path).endswith((".yaml", ".yml")) else json.loads(text)
    except (OSError, yaml.YAMLError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def load_section(path: str | Path, *names: str) -> dict[str, Any]:
    """``data[names[0]][names[1]]…`` of a config file; a missing section is a ``ConfigError`` naming it."""
    data: Any = read_mapping(path)
    where = str(path)
    for name in names:
        if not isinstance(data.get(name), dict):
            raise ConfigError(f"{where}: no section {name!r} (have {sorted(data)})")
        data, where = data[name], f"{where}:{name}"
    return dict(data)


def load_model(
    model: type[M], path: str | Path | None, section: str | Sequence[str], overrides: Mapping[str, Any] | None = None
) -> M:
    """``model`` validated from a config file, then the non-None ``overrides`` (top-level fields).

    A deployment file holds one section per process: its ``section`` mapping is read when there is
    one, else the whole file. A nested section (``("relays", "us-east")``) must exist. ``path=None``
    starts from the model's defaults.
    """
    data: dict[str, Any] = {}
    if path is not None and isinstance(section, str):
        data = read_mapping(path)
        if isinstance(data.get(section), dict):
            data = data[section]
    elif path is not None:
        data = load_section(path, *section)
    data = {**data, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    try:
        return model.model_validate(data)
    except ValidationError as err:
        where = section if isinstance(section, str) else ":".join(section)
        raise ConfigError(f"{path or f'{where} config'}: {err}") from err


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"8G"``, ``"512MiB"``, ``"1000000"`` → bytes (binary multiples); ``ValueError`` names bad text."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a byte size: {text!r}")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)
