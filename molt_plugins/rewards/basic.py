"""Simple text rewards."""

from __future__ import annotations

from typing import Any


def exact_match(response: str, task: dict[str, Any], strip: bool = True) -> float:
    """1.0 if ``response`` equals ``task["answer"]`` (both stripped when ``strip``), else 0.0.

    Raises:
        KeyError: the task has no ``answer`` field.
    """
    if "answer" not in task:
        raise KeyError("exact_match needs task['answer']")
    a, b = str(response), str(task["answer"])
    if strip:
        a, b = a.strip(), b.strip()
    return 1.0 if a == b else 0.0
