"""Tasks with verifiable rewards: a built-in synthetic one and GSM8K/MATH-style answer checking.

A task hands out :class:`TaskPrompt` s (id, text, reference answer) and scores a completion's text
against the answer. Scoring is a pure function of ``(answer, completion text, finish reason)``, so
actors, the trainer and audits all compute the same reward.

* ``addition``: ``"3+4="`` -> ``"7"`` then eos, for a tiny model learning from scratch. The reward
  is dense: a share for answering with digits only, a share for stopping (eos) after a short answer,
  and the rest for numeric closeness to the sum (full marks only when exact).
* ``jsonl``: a local file of ``{"question": ..., "answer": ...}`` lines (GSM8K, MATH). The final
  answer is taken from ``#### x``, the last ``\\boxed{x}``, or the last number in the text, on both
  sides, and compared after normalisation (commas, ``$``, trailing ``.0``, fractions, spaces).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from deltarl.errors import ConfigError


@dataclass(frozen=True)
class TaskPrompt:
    """One prompt of a task: a stable id, its text, and the reference answer the reward checks."""

    prompt_id: str
    text: str
    answer: str


class Task(Protocol):
    """Hands out prompts and scores completions."""

    name: str

    def prompts(self, step: int, count: int) -> list[TaskPrompt]:
        """``count`` prompts for ``step`` (deterministic in the task's seed and ``step``)."""
        ...

    def score(self, answer: str, completion: str, finish_reason: str = "stop") -> float:
        """Reward in [0, 1] of ``completion`` (text, eos dropped) against ``answer``."""
        ...


class TaskSpec(BaseModel):
    """Which task a run trains on; stored in ``<run>/model.json`` so actors score the same way."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["addition", "jsonl"] = Field(default="addition", description="'addition' (synthetic) or 'jsonl' (local dataset)")
    path: str | None = Field(default=None, description="jsonl: local file with 'question' and 'answer' per line")
    max_operand: int = Field(default=9, ge=1, le=10**6, description="addition: operands are drawn from 0..max_operand")
    prompt_template: str = Field(default="{question}", description="jsonl: prompt text; '{question}' is replaced by the question"
    )
    seed: int = Field(default=0, ge=0, description="seed of the prompt order")


# --- the synthetic task ------------------------------------------------------------------------


class AdditionTask:
    """``"a+b="`` -> ``"a+b"`` then eos; a dense reward a tiny model climbs from scratch in minutes."""

    name = "addition"

    def __init__(self, max_operand: int = 9, seed: int = 0) -> None:
        self.max_operand = max_operand
        self.seed = seed
        self._all = [
            TaskPrompt(f"add-{a}-{b}", f"{a}+{b}=", str(a + b))
            for a in range(max_operand + 1)
            for b in range(max_operand + 1)
        ]

    def prompts(self, step: int, count: int) -> list[TaskPrompt]:
        rng = random.Random(self.seed * 1_000_003 + step)
        if count <= len(self._all):
            return rng.sample(self._all, count)
        return [rng.choice(self._all) for _ in range(count)]

    def score(self, answer: str, completion: str, finish_reason: str = "stop") -> float:
        return addition_reward(answer, completion, finish_reason, scale=2 * self.max_operand)


def addition_reward(answer: str, completion: str, finish_reason: str, *, scale: int) -> float:
    """0.25 x digit share + 0.25 x (stopped, at most one char longer than the answer) + 0.5 x closeness."""
    text = completion.strip()
    if not text:
        return 0.0
    digit_share = sum(ch.isdigit() for ch in text) / len(text)
    stopped = finish_reason == "stop" and len(text) <= len(answer) + 1
    closeness = 0.0
    if text.isdigit():
        err = abs(int(text) - int(answer))
        closeness = 1.0 if err == 0 else 0.6 * max(0.0, 1.0 - err / max(scale, 1))
    return 0.25 * digit_share + 0.25 * float(stopped) + 0.5 * closeness


# --- GSM8K / MATH style ------------------------------------------------------------------------

_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces balanced), or ``None``."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i = start = starts[-1]
    depth = 1
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: ``#### x``, else the last ``\\boxed{x}``, else the last number."""
    m = list(_HASHES.finditer(text))
    if m:
        return m[-1].group(1).strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def normalize_answer(ans: str) -> str:
    """Canonical form: no ``$``/spaces/commas/trailing period, ``\\frac{a}{b}`` -> ``a/b``, numbers exact."""
    s = ans.strip().strip("$").strip()
    s = re.sub(r"\\(?:text|mathrm)\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\[dt]?frac\{([^}]*)\}\{([^}]*)\}", r"(\1)/(\2)", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("\\left", "").replace("\\right", "")
    s = s.replace(" ", "").replace(",", "").rstrip(".")
    s = re.sub(r"^\((-?[\d.]+)\)/\((-?[\d.]+)\)$", r"\1/\2", s)
    try:
        if re.fullmatch(r"-?\d+(?:\.\d+)?(?:/-?\d+(?:\.\d+)?)?|-?\.\d+", s):
            num = Fraction(s) if "/" not in s else Fraction(Fraction(s.split("/")[0]), Fraction(s.split("/")[1]))
            return str(num.numerator) if num.denominator == 1 else f"{num.numerator}/{num.denominator}"
    except (ValueError, ZeroDivisionError):
        pass
    return s.lower()


def answers_match(reference: str, completion: str) -> bool:
    """Whether the completion's final answer equals the reference's, after normalisation."""
    ref = extract_answer(reference)
    got = extract_answer(completion)
    if ref is None or got is None:
        return False
    return normalize_answer(ref) == normalize_answer(got)


class JsonlMathTask:
    """Prompts from a local JSONL dataset; reward 1 when the final answer matches, else 0."""

    name = "jsonl"

    def __init__(self, path: str | Path, *, template: str = "{question}", seed: int = 0) -> None:
        self.seed = seed
        self._items: list[TaskPrompt] = []
        self._epoch_order: tuple[int, list[int]] = (-1, [])
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise ConfigError(f"cannot read dataset {path}: {err}") from err
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                q, a = str(row["question"]), str(row["answer"])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ConfigError(f"{path}:{lineno}: need a JSON object with 'question' and 'answer'") from err
            self._items.append(TaskPrompt(f"q{lineno - 1}", template.replace("{question}", q), a))
        if not self._items:
            raise ConfigError(f"dataset {path} is empty")

    def __len__(self) -> int:
        return len(self._items)

    def prompts(self, step: int, count: int) -> list[TaskPrompt]:
        """Walk a seeded permutation of the dataset, ``count`` prompts per step (epochs wrap)."""
        n = len(self._items)
        out: list[TaskPrompt] = []
        for k in range(step * count, (step + 1) * count):
            epoch, pos = divmod(k, n)
            out.append(self._items[self._order(epoch)[pos]])
        return out

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order[0] != epoch:
            order = list(range(len(self._items)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def score(self, answer: str, completion: str, finish_reason: str = "stop") -> float:
        return 1.0 if answers_match(answer, completion) else 0.0


def build_task(spec: TaskSpec) -> Task:
    """The task ``spec`` names."""
    if spec.kind == "addition":
        return AdditionTask(spec.max_operand, spec.seed)
    if not spec.path:
        raise ConfigError("task kind 'jsonl' needs a path")
    return JsonlMathTask(spec.path, template=spec.prompt_template, seed=spec.seed)
