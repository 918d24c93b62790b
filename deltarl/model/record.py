"""The run's ``model.json`` record: which model, tokenizer, task and sampling settings a run uses.

Written once by the trainer before version 0 (``put_if_absent``), read by actors, followers and
audits to rebuild and sample the same model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from deltarl.errors import FormatError, ObjectExists, RunError, UnsupportedFormatVersion
from deltarl.model.build import ModelSpec
from deltarl.model.tokenizer import TokenizerSpec
from deltarl.storage.store import ObjectStore

MODEL_JSON_FORMAT = 1


@dataclass(frozen=True)
class RunModelInfo:
    """What ``<run>/model.json`` records: enough for actors and audits to rebuild and sample the model."""

    model: ModelSpec
    tokenizer: TokenizerSpec
    task: dict[str, Any] | None = None
    temperature: float = 1.0
    max_new_tokens: int = 256

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no whitespace), so the same info always has the same bytes."""
        record: dict[str, Any] = {
            "format_version": MODEL_JSON_FORMAT,
            "model": self.model.model_dump(mode="json"),
            "tokenizer": self.tokenizer.model_dump(mode="json"),
            "task": self.task,
            "generation": {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens},
        }
        return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RunModelInfo:
        """Parse ``model.json``; malformed bytes raise ``FormatError``, an unknown version
        ``UnsupportedFormatVersion``."""
        try:
            record = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise FormatError(f"model.json is not JSON: {err}") from err
        if not isinstance(record, dict):
            raise FormatError("model.json is not a JSON object")
        if record.get("format_version") != MODEL_JSON_FORMAT:
            raise UnsupportedFormatVersion(f"model.json format_version {record.get('format_version')!r}")
        try:
            gen = record["generation"]
            return cls(
                model=ModelSpec(**record["model"]),
                tokenizer=TokenizerSpec(**record["tokenizer"]),
                task=record["task"],
                temperature=float(gen["temperature"]),
                max_new_tokens=int(gen["max_new_tokens"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise FormatError(f"model.json is malformed: {err}") from err


def model_json_key(run: str) -> str:
    return f"{run}/model.json"


def write_model_json(store: ObjectStore, run: str, data: bytes) -> None:
    """Create ``<run>/model.json`` once; an existing one must hold the same bytes (else ``RunError``)."""
    key = model_json_key(run)
    try:
        store.put_if_absent(key, data)
    except ObjectExists:
        if store.get(key) != data:
            raise RunError(f"{key} exists with a different model/tokenizer/task spec") from None


def read_model_json(store: ObjectStore, run: str) -> RunModelInfo:
    """The model, tokenizer, task and sampling settings a run records."""
    return RunModelInfo.from_bytes(store.get(model_json_key(run)))
