"""Tasks: the synthetic addition reward, answer extraction and normalisation, JSONL datasets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltarl.errors import ConfigError
from deltarl.model.tasks import (
    AdditionTask,
    JsonlMathTask,
    TaskSpec,
    answers_match,
    build_task,
    extract_answer,
    normalize_answer,
)


def test_addition_prompts_are_deterministic_and_unique() -> None:
    task = AdditionTask(max_operand=9, seed=3)
    a, b = task.prompts(5, 32), task.prompts(5, 32)
    assert a == b
    assert len({p.prompt_id for p in a}) == 32
    assert task.prompts(6, 32) != a
    for p in a:
        x, y = p.text.rstrip("=").split("+")
        assert int(p.answer) == int(x) + int(y)
    assert len(task.prompts(0, 150)) == 150  # more than the 100 distinct prompts: drawn with repeats


@pytest.mark.parametrize(
    ("completion", "reason", "expected"),
    [
        ("7", "stop", 1.0),
        ("", "stop", 0.0),
        ("7", "length", 0.75),  # right number, never stopped
        ("abc", "stop", 0.0),  # stopped but three chars for a one-char answer
        ("a", "stop", 0.25),  # stopped, short, no digit
    ],
)
def test_addition_reward_values(completion: str, reason: str, expected: float) -> None:
    assert AdditionTask().score("7", completion, reason) == pytest.approx(expected)


def test_addition_reward_is_dense_and_ordered() -> None:
    task = AdditionTask()
    exact = task.score("12", "12", "stop")
    near = task.score("12", "11", "stop")
    far = task.score("12", "2", "stop")
    digits_no_stop = task.score("12", "98765", "length")
    mixed = task.score("12", "9x7!", "length")
    garbage = task.score("12", "xyz!", "length")
    assert exact == 1.0
    assert 1.0 > near > far > digits_no_stop > mixed > garbage == 0.0


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("Natalia sold 48 clips... 48+24 = 72\n#### 72", "72"),
        ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("nested \\boxed{x^{2}+1} then \\boxed{5}", "5"),
        ("it costs $1,250.50 in total", "1,250.50"),
        ("no number here", None),
        ("#### -3", "-3"),
    ],
)
def test_extract_answer(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("a", "b"),
    [("1,000", "1000"), ("$72", "72"), ("3.0", "3"), ("\\frac{1}{2}", "0.5"), ("2/4", "1/2"), ("72.", "72"), ("\\dfrac{3}{6}", "1/2")],
)
def test_normalize_equal(a: str, b: str) -> None:
    assert normalize_answer(a) == normalize_answer(b)


def test_normalize_different() -> None:
    assert normalize_answer("72") != normalize_answer("27")
    assert normalize_answer("x+1") == "x+1"


def test_answers_match_gsm8k_and_math() -> None:
    assert answers_match("He has 3 + 4 = 7 apples.\n#### 7", "Adding: 3 + 4 = 7. The answer is 7.")
    assert answers_match("#### 1,200", "so \\boxed{1200}")
    assert not answers_match("#### 7", "The answer is 8.")
    assert not answers_match("#### 7", "I do not know.")


def test_jsonl_task(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    rows = [{"question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = build_task(TaskSpec(kind="jsonl", path=str(path), prompt_template="Q: {question}\nA:"))
    assert isinstance(task, JsonlMathTask)
    assert len(task) == 5
    epoch = task.prompts(0, 5)
    assert sorted(p.prompt_id for p in epoch) == [f"q{i}" for i in range(5)]  # one epoch covers every row once
    assert epoch[0].text.startswith("Q: What is ")
    p = epoch[0]
    right = p.answer.split("#### ")[1]
    assert task.score(p.answer, f"The answer is {right}.") == 1.0
    assert task.score(p.answer, "The answer is 99.") == 0.0
    assert task.prompts(1, 3) == task.prompts(1, 3)


def test_jsonl_task_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        build_task(TaskSpec(kind="jsonl"))
    with pytest.raises(ConfigError):
        JsonlMathTask(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1"):
        JsonlMathTask(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError):
        JsonlMathTask(empty)
