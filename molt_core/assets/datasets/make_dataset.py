"""Build the datasets molt ships (``builtin:NAME`` for the ``dataset`` env and ``molt sft --data``).

``python -m molt_core.assets.datasets.make_dataset`` regenerates every file below this
directory byte for byte (fixed seeds, sorted JSON keys, ``\\n`` line ends). It needs
reasoning-gym (Apache-2.0, https://github.com/open-thought/reasoning-gym), which generates
the problems; the shipped files themselves need nothing.

``chain_sum`` -- reasoning-gym's ``chain_sum`` task with three one-digit terms joined by
``+`` / ``-`` (``"4 - 1 - 7"`` -> ``"-4"``): 4,000 possible problems, about as hard for the
~0.85M-parameter ``builtin:tiny-qwen3`` as the quickstart's 2-digit addition. Problems are
drawn from ``chain_sum`` seeded :data:`SEED`, de-duplicated by expression, shuffled, and cut
into ``test.jsonl`` (:data:`N_TEST` rows) and ``train.jsonl`` (:data:`N_TRAIN` rows): the
splits share no expression. Rows are ``{"expression", "answer"}``; ``answer`` is
reasoning-gym's (an integer as text). ``sft.jsonl`` holds the first :data:`N_SFT` train rows
as ``{"prompt", "completion"}`` pairs, prompts rendered with :data:`TEMPLATE`, for
``molt sft --data``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["SEED", "N_TRAIN", "N_TEST", "N_SFT", "TEMPLATE", "chain_sum_rows", "build"]

OUT_DIR = Path(__file__).resolve().parent
SEED = 20261130
N_TRAIN, N_TEST, N_SFT = 3000, 300, 500
#: The prompt ``recipes/dataset.toml`` renders from a row (``agent.options.template``).
TEMPLATE = "What is {expression}?"
_CONFIG = {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1, "allow_negation": False}


def chain_sum_rows() -> list[dict[str, str]]:
    """The distinct ``{"expression", "answer"}`` rows, in the shuffled order the splits are cut from."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset("chain_sum", **_CONFIG, seed=SEED, size=40_000)
    seen: dict[str, str] = {}
    for item in ds:
        seen.setdefault(item["metadata"]["expression"], str(item["answer"]))
    rows = [{"expression": e, "answer": a} for e, a in sorted(seen.items())]
    random.Random(SEED).shuffle(rows)
    if len(rows) < N_TRAIN + N_TEST:
        raise RuntimeError(f"chain_sum gave {len(rows)} distinct problems, fewer than {N_TRAIN + N_TEST}")
    return rows


def _write(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")


def build(out_dir: Path = OUT_DIR) -> list[Path]:
    """Write ``chain_sum/{train,test,sft}.jsonl`` under ``out_dir``; returns the paths."""
    rows = chain_sum_rows()
    test, train = rows[:N_TEST], rows[N_TEST:N_TEST + N_TRAIN]
    sft = [{"prompt": TEMPLATE.format(**r), "completion": r["answer"]} for r in train[:N_SFT]]
    d = out_dir / "chain_sum"
    paths = [d / "train.jsonl", d / "test.jsonl", d / "sft.jsonl"]
    for p, r in zip(paths, (train, test, sft)):
        _write(p, r)
    return paths


if __name__ == "__main__":
    for p in build():
        print(p, p.stat().st_size, "bytes")
