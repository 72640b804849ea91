"""Robustness of the quickstart recipe over seeds and torch thread counts.

Runs ``molt run quickstart --local`` (the whole recipe: SFT warm start, then GRPO) once per
``(variant, seed, threads)`` as parallel subprocesses, each pinned to ``threads`` torch threads
(``run.threads``; ``OMP_NUM_THREADS`` is left unset so nothing but the recipe decides), and
reads each run's ``metrics.jsonl``:

* ``warm`` -- held-out ``eval/pass@1`` at step 0 (after the warm start, before RL);
* ``final`` -- held-out ``eval/pass@1`` after the last step;
* ``hit`` -- the first step at which the ``--window``-step moving average of the per-step mean
  reward reaches ``--target`` (a full window is required), or ``-`` if it never does.

A variant is a name and a list of ``--set`` overrides (``--variant NAME:KEY=V,KEY=V``); the
default is the shipped recipe as it is. Per variant it reports the min / median / max of
``warm`` and ``final`` over every seed and thread count, and on how many runs the target was
hit. Writes ``OUT/bench_quickstart_seeds.json`` and ``OUT/bench_quickstart_seeds.png`` (the
moving-average reward of every run).

Usage::

    python benchmarks/bench_quickstart_seeds.py                       # 5 seeds x threads 1,2
    python benchmarks/bench_quickstart_seeds.py --seeds 5 --threads 1 2 --jobs 8 \\
        --variant base: --variant cos:sft.lr_schedule=cosine,sft.steps=1200

``--jobs`` runs at once; keep ``jobs x max(threads)`` at or below the core count. Other
environment variables pass through: on a machine shared with other jobs, run with
``OMP_WAIT_POLICY=PASSIVE`` so that OpenMP threads waiting at a barrier sleep instead of
spinning (``run.threads = 2`` on 2 cores busy with other jobs, load average 8-22: SFT warm start
0.3 steps/s spinning, 3.4 passive; what is computed is the same, only idle threads differ).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any


def moving_average(xs: list[float], window: int) -> list[float]:
    """Trailing mean over full windows: element ``i`` is ``mean(xs[i : i + window])``."""
    return [sum(xs[i:i + window]) / window for i in range(len(xs) - window + 1)]


def first_hit(rewards: list[float], window: int, target: float) -> int | None:
    """1-based step at which the ``window``-step moving average first reaches ``target``."""
    for i, m in enumerate(moving_average(rewards, window)):
        if m >= target:
            return i + window
    return None


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``NAME:KEY=V,KEY=V`` -> ``(NAME, ["KEY=V", "KEY=V"])`` (``NAME:`` = no override)."""
    name, _, rest = spec.partition(":")
    return name, [x for x in rest.split(",") if x]


def run_one(out: Path, name: str, sets: list[str], seed: int, threads: int, extra: list[str]) -> dict[str, Any]:
    """One ``molt run quickstart --local`` subprocess; returns its figures (``error`` on failure)."""
    d = out / f"{name}-s{seed}-t{threads}"
    cmd = [sys.executable, "-m", "molt_core.cli", "run", "quickstart", "--local", "--out", str(d),
           "--set", f"run.seed={seed}", "--set", f"run.threads={threads}"]
    for s in [*extra, *sets]:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    t0 = time.perf_counter()
    with open(out / f"{d.name}.log", "w") as logf:
        rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env).returncode
    res: dict[str, Any] = {"variant": name, "seed": seed, "threads": threads, "rc": rc,
                           "wall_s": time.perf_counter() - t0}
    try:
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except OSError as e:
        return {**res, "error": str(e)}
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if r.get("eval/pass@1") is not None]
    res["warm"] = next((p for s, p in evals if s == 0), None)
    res["final"] = evals[-1][1] if evals else None
    res["rewards"] = [r["reward/mean"] for r in rows if r.get("step", 0) > 0 and "reward/mean" in r]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="run.threads values")
    ap.add_argument("--variant", action="append", default=[], help="NAME:KEY=V,KEY=V (repeatable)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="override for every run")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--out", default=f"runs/bench-quickstart-seeds-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [parse_variant(v) for v in (args.variant or ["recipe:"])]
    jobs = [(n, s, seed, t) for n, s in variants for seed in range(args.seeds) for t in args.threads]
    results: list[dict[str, Any]] = []
    with Progress(console=Console(stderr=True)) as prog, ThreadPoolExecutor(args.jobs) as pool:
        bar = prog.add_task("quickstart runs", total=len(jobs))
        futs = [pool.submit(run_one, out, n, s, seed, t, args.extra) for n, s, seed, t in jobs]
        for f in as_completed(futs):
            results.append(f.result())
            prog.advance(bar)
            # written after every run, so an interrupted sweep keeps what finished
            (out / "bench_quickstart_seeds.json").write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))
    results.sort(key=lambda r: (r["variant"], r["seed"], r["threads"]))
    for r in results:
        r["hit"] = first_hit(r.get("rewards") or [], args.window, args.target)
    table = Table(title=f"quickstart over {args.seeds} seeds x threads {args.threads}")
    for c in ("variant", "warm pass@1 min/med/max", "final pass@1 min/med/max", f"MA{args.window} >= {args.target}",
              "hit steps", "failed"):
        table.add_column(c)
    summary = {}
    for n, sets in variants:
        rs = [r for r in results if r["variant"] == n]
        ok = [r for r in rs if r.get("warm") is not None and r.get("final") is not None]

        def band(key: str) -> list[float]:
            xs = sorted(r[key] for r in ok)
            return [xs[0], xs[len(xs) // 2], xs[-1]] if xs else []

        hits = [r["hit"] for r in rs if r["hit"] is not None]
        summary[n] = {"sets": sets, "warm": band("warm"), "final": band("final"), "hits": len(hits), "runs": len(rs),
                      "failed": len(rs) - len(ok)}
        fmt = lambda b: " / ".join(f"{x:.3f}" for x in b) if b else "-"  # noqa: E731
        table.add_row(n, fmt(summary[n]["warm"]), fmt(summary[n]["final"]), f"{len(hits)} of {len(rs)}",
                      " ".join(str(h) for h in sorted(hits)), str(summary[n]["failed"]))
    Console().print(table)
    (out / "bench_quickstart_seeds.json").write_text(json.dumps({"args": vars(args), "summary": summary,
                                                                "runs": results}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(variants), figsize=(5 * len(variants), 3.5), squeeze=False)
        for ax, (n, _) in zip(axes[0], variants):
            for r in results:
                if r["variant"] == n and r.get("rewards"):
                    ma = moving_average(r["rewards"], args.window)
                    ax.plot(range(args.window, args.window + len(ma)), ma, lw=1,
                            label=f"s{r['seed']} t{r['threads']}")
            ax.axhline(args.target, color="k", ls="--", lw=0.8)
            ax.set_title(n)
            ax.set_xlabel("step")
            ax.set_ylabel(f"reward MA{args.window}")
        axes[0][-1].legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(out / "bench_quickstart_seeds.png", dpi=120)
    except ImportError:  # matplotlib is optional
        pass
    print(f"wrote {out / 'bench_quickstart_seeds.json'}")


if __name__ == "__main__":
    main()
