"""``molt show RUN_DIR``: print a readable sample of a run's ``trajectories.jsonl`` -- per
rollout its status, reward, policy versions and each turn's context and response text.

Rows written with decoded text (``turns``, :func:`molt_core.runtime.rundir.decode_turns`) are
printed as they are; older rows (token ids only) are decoded with the tokenizer of the run's
``config.toml`` model when it loads. Plain text when the output is not a terminal.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

__all__ = ["load_rows", "pick_step", "show_run"]


def load_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``RUN_DIR/trajectories.jsonl`` (blank lines skipped).

    Raises:
        ValueError: no such file (naming it and when a run writes it), or a line that is
            not JSON (naming its number).
    """
    path = Path(run_dir) / "trajectories.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: no such file; `molt run` writes it at step 1, every 10th step and the last "
                         f"(is {run_dir} a run directory?)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e})") from None
    return rows


def pick_step(rows: list[dict[str, Any]], step: int | None) -> int:
    """``step`` if some row has it, else the latest step when ``step`` is None.

    Raises:
        ValueError: no rows, or no row of ``step`` (the message lists the steps there are).
    """
    steps = sorted({int(r.get("step", 0)) for r in rows})
    if not steps:
        raise ValueError("trajectories.jsonl holds no rows yet")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ValueError(f"--step {step}: no sampled trajectories at that step; steps with samples: "
                         f"{', '.join(map(str, steps))}")
    return step


def _versions(row: dict[str, Any]) -> str:
    vs = [v for seg in row.get("segments", []) for v in seg.get("versions", []) if v is not None]
    if not vs:
        return "-"
    return str(min(vs)) if min(vs) == max(vs) else f"{min(vs)}-{max(vs)}"


_IMAGE_RUN = re.compile(r"(?:<\|image_pad\|>)+")


def collapse_images(text: str) -> str:
    """``text`` with each run of ``<|image_pad|>`` placeholders (one image's tokens) shown as
    ``[image: N tokens]``: a real Qwen2.5-VL image is up to thousands of them."""
    return _IMAGE_RUN.sub(lambda m: f"[image: {len(m.group(0)) // len('<|image_pad|>')} tokens]", text)


def _task_line(task: dict[str, Any]) -> str:
    """``task: answer=...`` (its ``answer`` / ``id`` fields when present: the prompt is in the
    turns), else its JSON cut at 200 characters."""
    keys = [k for k in ("id", "answer") if k in task]
    if keys:
        return "task: " + "  ".join(f"{k}={json.dumps(task[k], ensure_ascii=False)[:100]}" for k in keys)
    text = json.dumps(task, ensure_ascii=False)
    return f"task: {text[:200]}{'...' if len(text) > 200 else ''}"


def _tokenizer_of(run_dir: Path) -> Any:
    """The tokenizer of the run's model (from ``config.toml``), or None when it cannot load."""
    try:
        from molt_core.cli.recipe import load_config
        from molt_core.models import load_tokenizer

        cfg = load_config(str(run_dir / "config.toml"), [])
        return load_tokenizer(cfg.model.path, gguf_file=cfg.model.gguf_file)
    except Exception:  # display only: fall back to token counts
        return None


def _turns(row: dict[str, Any], tokenizer: Any) -> list[dict[str, Any]] | None:
    if "turns" in row:
        return row["turns"]
    if tokenizer is None:
        return None
    from molt_core.runtime.rundir import decode_turns
    from molt_core.types import Trajectory

    fields = {k: v for k, v in row.items() if k in Trajectory.model_fields}
    return decode_turns(Trajectory.model_validate(fields), tokenizer)


def show_run(run_dir: str | Path, step: int | None = None, n: int = 4, console: Console | None = None) -> int:
    """Print up to ``n`` sampled rollouts of ``step`` (default: the latest sampled step) of
    ``run_dir``: a header per rollout (step, rollout id, status, reward, score, policy
    versions of its sampled tokens, truncation), the task, each turn's context and response
    and, for a failed rollout, its error. Returns the number of rollouts printed.

    Raises:
        ValueError: see :func:`load_rows` and :func:`pick_step`.
    """
    run_dir = Path(run_dir)
    console = console or Console(soft_wrap=True)  # long lines stay whole (no hard wrap at the width)
    rows = load_rows(run_dir)
    step = pick_step(rows, step)
    picked = [r for r in rows if int(r.get("step", 0)) == step][:n]
    tokenizer = _tokenizer_of(run_dir) if any("turns" not in r for r in picked) else None
    total = sum(int(r.get("step", 0)) == step for r in rows)
    console.print(f"{run_dir}: step {step}, {len(picked)} of {total} sampled rollouts", highlight=False, markup=False)
    for r in picked:
        reward = "-" if r.get("reward") is None else f"{r['reward']:.3f}"
        head = f"{r.get('rollout_id', '?')}  {r.get('status', '?')}  reward {reward}"
        if r.get("score") is not None:
            head += f"  score {r['score']:.3f}"
        head += f"  versions {_versions(r)}" + ("  truncated" if r.get("truncated") else "")
        # a plain line, never cut: a Rule truncates its title at the console width (80 columns
        # when redirected), and a real rollout id leaves no room for "versions ..." / "truncated"
        console.print(Text(f"── {head} ──", style="bold"))
        if r.get("task"):
            console.print(Text(_task_line(r["task"]), style="dim"))
        turns = _turns(r, tokenizer)
        if turns is None:
            n_tok = sum(len(s.get("token_ids", [])) for s in r.get("segments", []))
            console.print(Text(f"({n_tok} tokens; no decoded text and the run's tokenizer did not load)", style="dim"))
        for i, t in enumerate(turns or [], 1):
            v = t.get("versions")
            tag = "" if not v else (f" (v{v[0]})" if v[0] == v[1] else f" (v{v[0]}-{v[1]})")
            console.print(Text(f"[turn {i}] context:", style="bold"))
            console.print(Text(collapse_images(t.get("context", "")), style="dim"))
            console.print(Text(f"[turn {i}] response{tag}:", style="bold green"))
            console.print(Text(t.get("response", "")))
        if r.get("status") != "ok" and r.get("error"):
            console.print(Text(f"error: {r['error']}", style="red"))
    return len(picked)
