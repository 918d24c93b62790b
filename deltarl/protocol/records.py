"""The coordinator's on-wire and stored records: frozen pydantic models with an explicit format version.

Every record carries ``format_version``; :func:`decode` rejects versions this build does not read
with :class:`~deltarl.errors.UnsupportedFormatVersion` and malformed bytes with
:class:`~deltarl.errors.FormatError`, never patching them up. :func:`encode` writes canonical JSON
(sorted keys, no whitespace), so the same record always has the same bytes and sha256.

Rewards: the actor holds the task's answer for each prompt it leases and fills ``Sample.reward``
with the task's verifier; a trainer may recompute it and keep its own number (``Sample.reward`` is
the actor's claim, stored as reported).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deltarl.errors import FormatError, NonFiniteValue, UnsupportedFormatVersion

FORMAT_VERSION: Literal[1] = 1

#: Largest step number: step keys are 12 digits wide (``step-000000000000``).
MAX_STEP = 10**12 - 1
#: Caps on a record's fields (the request body as a whole is capped by the service's ``max_body_bytes``).
MAX_TEXT = 1 << 20
MAX_TOKENS = 1 << 20
MAX_PROMPTS = 1 << 16
MAX_SAMPLES = 1 << 16
MAX_NAME = 256
MAX_JSON_DEPTH = 64

RecordT = TypeVar("RecordT", bound="Record")


class Record(BaseModel):
    """Base of every coordinator record: frozen, unknown fields rejected, versioned."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    format_version: Literal[1] = FORMAT_VERSION


class PromptItem(BaseModel):
    """One prompt of a step. ``group_size`` completions are generated for it (GRPO groups)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    prompt_id: str = Field(min_length=1, max_length=256, description="unique within the step")
    text: str = Field(max_length=MAX_TEXT, description="the prompt as text (chat template already applied, or raw)")
    token_ids: list[int] | None = Field(default=None, max_length=MAX_TOKENS,
                                        description="pre-tokenized prompt, if the trainer has it")
    answer: str | None = Field(default=None, max_length=MAX_TEXT, description="reference answer for the task's verifier")
    group_size: int = Field(default=1, ge=1, le=4096, description="completions wanted for this prompt")


class Sample(BaseModel):
    """One completion of one prompt, with what training and audit need. Every number is finite."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    prompt_id: str = Field(max_length=MAX_NAME)
    prompt_token_ids: list[int] = Field(max_length=MAX_TOKENS)
    completion_token_ids: list[int] = Field(max_length=MAX_TOKENS)
    completion_text: str = Field(max_length=MAX_TEXT)
    logprobs: list[float] = Field(max_length=MAX_TOKENS, description="log-probability of each sampled completion token")
    reward: float | None = Field(default=None, description="the actor's verifier reward, if computed")
    finish_reason: str = Field(default="stop", max_length=MAX_NAME, description="'stop', 'length', ...")

    @model_validator(mode="after")
    def _logprobs_match_tokens(self) -> Sample:
        if len(self.logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"{len(self.logprobs)} logprobs for {len(self.completion_token_ids)} completion tokens"
            )
        return self


class RolloutResult(Record):
    """What an actor reports for one lease: every completion of every leased prompt."""

    step: int = Field(ge=0, le=MAX_STEP)
    lease_id: str = Field(min_length=1, max_length=128)
    actor_id: str = Field(min_length=1, max_length=128)
    version_id: str = Field(min_length=1, max_length=128, description="the policy version that generated")
    samples: list[Sample] = Field(max_length=MAX_SAMPLES)
    gen_seconds: float = Field(ge=0.0, description="the actor's own generation time for this lease")
    tokens: int = Field(ge=0, description="generated tokens: the sum of completion lengths")
    started_at: float | None = Field(default=None, description="actor wall clock when generation began")

    @model_validator(mode="after")
    def _tokens_match(self) -> RolloutResult:
        total = sum(len(s.completion_token_ids) for s in self.samples)
        if total != self.tokens:
            raise ValueError(f"tokens={self.tokens} but the samples hold {total} completion tokens")
        return self

    def prompt_counts(self) -> dict[str, int]:
        """Completions per prompt id."""
        counts: dict[str, int] = {}
        for s in self.samples:
            counts[s.prompt_id] = counts.get(s.prompt_id, 0) + 1
        return counts


class StepSpec(Record):
    """A step the trainer opens: its prompts and the version ids whose rollouts it accepts.

    ``accepted_versions`` lists newest first; actors should generate with the first one. With the
    default one-step asynchrony a trainer passes ``[v_n, v_{n-1}]``; the coordinator refuses more
    than ``max_staleness + 1`` ids.
    """

    step: int = Field(ge=0, le=MAX_STEP)
    prompts: list[PromptItem] = Field(min_length=1, max_length=MAX_PROMPTS)
    accepted_versions: list[str] = Field(min_length=1, max_length=64)
    opened_at: float | None = None

    @model_validator(mode="after")
    def _unique_prompts(self) -> StepSpec:
        ids = [p.prompt_id for p in self.prompts]
        if len(set(ids)) != len(ids):
            raise ValueError("prompt ids repeat within the step")
        return self

    def same_request(self, other: StepSpec) -> bool:
        """Whether two specs open the same step (``opened_at`` aside): a retried POST."""
        return self.model_copy(update={"opened_at": None}) == other.model_copy(update={"opened_at": None})


class ActorRecord(Record):
    """A registered actor, persisted when it registers."""

    actor_id: str
    region: str = ""
    backend: str = ""
    capabilities: dict[str, Any] = Field(default_factory=dict)
    registered_at: float
    secret_sha256: str | None = Field(default=None, description="sha256 of the actor's secret (never the secret)")


class LeaseRecord(Record):
    """A grant of prompts to one actor until a deadline; persisted before the actor sees it."""

    lease_id: str
    step: int
    actor_id: str
    prompt_ids: list[str]
    granted_at: float
    deadline: float
    expected_tokens: float = Field(ge=0.0, description="the scheduler's estimate of the work")


class LeaseGrant(Record):
    """The lease as the actor receives it: the record plus the prompts and accepted versions."""

    lease: LeaseRecord
    prompts: list[PromptItem]
    accepted_versions: list[str]


class AdmittedRecord(Record):
    """An admitted result as stored under ``<run>/rollouts/step-<n>/results/``: immutable."""

    step: int
    result: RolloutResult
    lease: LeaseRecord
    admitted_at: float
    result_sha256: str = Field(description="sha256 of the result's canonical JSON")


class StepManifest(Record):
    """The closing record of a step: every admitted result, written once the step is complete."""

    step: int
    spec_sha256: str
    result_keys: list[str] = Field(description="store keys of the admitted records, sorted")
    lease_ids: list[str]
    prompts: int
    samples: int
    tokens: int
    opened_at: float | None
    closed_at: float


class Ack(Record):
    """The coordinator's answer to a reported result."""

    admitted: bool
    duplicate: bool = False
    reason: str | None = None
    message: str | None = None
    key: str | None = None


def encode(record: BaseModel) -> bytes:
    """Canonical JSON bytes of a record (sorted keys, compact)."""
    return json.dumps(record.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()


def sha256_of(record: BaseModel) -> str:
    """Hex sha256 of the record's canonical JSON."""
    return hashlib.sha256(encode(record)).hexdigest()


def _no_constant(name: str) -> float:
    raise NonFiniteValue(f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteValue(f"{text[:40]} overflows to {value}")
    return value


def _depth(text: bytes | str) -> int:
    """Deepest nesting of ``[``/``{`` outside strings (a cheap pre-check before ``json.loads``)."""
    raw = text.encode() if isinstance(text, str) else text
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return 0
    depth = best = 0
    in_str = esc = False
    for c in raw:
        if in_str:
            if esc:
                esc = False
            elif c == 0x5C:
                esc = True
            elif c == 0x22:
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x5B, 0x7B):
            depth += 1
            if depth > best:
                best = depth
                if best > MAX_JSON_DEPTH:
                    return best
        elif c in (0x5D, 0x7D):
            depth -= 1
    return best


def decode(cls: type[RecordT], data: bytes | str | dict[str, Any]) -> RecordT:
    """Parse a record (strictly: no booleans as integers, no NaN/Infinity, at most
    ``MAX_JSON_DEPTH`` levels), refusing unknown format versions and malformed content."""
    try:
        if isinstance(data, (bytes, str)):
            if _depth(data) > MAX_JSON_DEPTH:
                raise FormatError(f"{cls.__name__}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
            obj = json.loads(data, parse_constant=_no_constant, parse_float=_finite_float)
        else:
            obj = data
    except NonFiniteValue as err:
        raise NonFiniteValue(f"{cls.__name__}: {err}") from err
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        if isinstance(err, FormatError):
            raise
        raise FormatError(f"{cls.__name__}: not JSON: {err}") from err
    if not isinstance(obj, dict):
        raise FormatError(f"{cls.__name__}: expected a JSON object, got {type(obj).__name__}")
    version = obj.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise UnsupportedFormatVersion(f"{cls.__name__}: format_version {version!r}, this build reads {FORMAT_VERSION}")
    try:
        return cls.model_validate(obj, strict=True)
    except ValidationError as err:
        if any(e.get("type") == "finite_number" for e in err.errors()):
            raise NonFiniteValue(f"{cls.__name__}: {err}") from err
        raise FormatError(f"{cls.__name__}: {err}") from err


# --- request/response bodies of the HTTP API --------------------------------------------------------


class RegisterRequest(Record):
    region: str = Field(default="", max_length=MAX_NAME)
    backend: str = Field(default="", max_length=MAX_NAME)
    capabilities: dict[str, Any] = Field(default_factory=dict, max_length=64)


class Registered(Record):
    """A new actor's id and its secret: the bearer token of every later call it makes."""

    actor_id: str
    heartbeat_interval_s: float
    actor_secret: str = Field(min_length=16, max_length=256)


class LeaseRequest(Record):
    actor_id: str = Field(max_length=128)
    max_prompts: int | None = Field(default=None, ge=1, le=MAX_PROMPTS)


class LeaseResponse(Record):
    """A grant, or none with a hint of when to ask again."""

    grant: LeaseGrant | None = None
    retry_after_s: float = 0.0


class HeartbeatRequest(Record):
    actor_id: str = Field(max_length=128)


class StepOpened(Record):
    step: int
    created: bool = Field(description="False when the same step was already open (an idempotent retry)")
    closed: bool = False


class StepResults(Record):
    """The admitted results of a step so far; ``complete`` once every prompt has one."""

    step: int
    complete: bool
    results: list[AdmittedRecord]
    manifest: StepManifest | None = None
