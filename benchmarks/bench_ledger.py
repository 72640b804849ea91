"""Ledger cost per turn, turns 1..N: the window-checked extend vs the full-render check, same run.

One agentic session per ledger on the shipped tiny tokenizer and its Qwen3-style template (a
system prompt, one tool, a think-block-free reply each turn; every fourth reply a tool call
answered by a tool message, the others answered by a user message), so every turn is an
*extend*. Two ledgers see the same requests, turn by turn, interleaved so machine load hits
both alike:

* ``window``: the default, the extend check renders a window of the conversation
  (:mod:`molt_core.ledger.render`);
* ``full``: ``Ledger()`` (no window prover), the reference check that renders the whole
  conversation twice per turn.

The cost of a turn is ``prepare`` + ``commit`` (the engine is a zero-cost scripted reply made
before the clock starts), of which message normalization (reading the request: the ``window``
ledger reuses the previous request's normalized prefix, the ``full`` one reads it all, as before). The two ledgers' plans are compared every turn
(same mode, prompt ids, tail ids and prompt text) -- a benchmark that measured a wrong answer
would stop there. Prints the median ms per turn over windows of ``--window`` turns (and the
window ledger's fastest turn there, the cost least disturbed by other load on a shared
machine) and the ratios last/first window; saves a plot of cost vs turn (``--plot``).

Usage: ``python benchmarks/bench_ledger.py [--turns 500] [--window 20] [--plot runs/bench_ledger.png]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from molt_core.ledger import Ledger, normalize_messages  # noqa: E402
from molt_core.models import load_tokenizer  # noqa: E402
from molt_core.testing import ScriptedEngine  # noqa: E402
from molt_core.types import SamplingParams  # noqa: E402
from molt_plugins.render_window import prove_window  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def wire(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message as an OpenAI client sends it back (arguments as a JSON string)."""
    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
             for c in message.get("tool_calls", [])]
    return {**message, "tool_calls": calls} if calls else message


def session(tok: Any, turns: int, gc_freeze: bool = False) -> dict[str, list[tuple[float, float]]]:
    """Per ledger (``window`` / ``full``), per turn: (prepare + commit seconds, of which
    message normalization)."""
    leds = {"window": Ledger(tok, window_prover=prove_window), "full": Ledger(tok)}
    eng = ScriptedEngine(tok)
    spent = [0.0]

    def timed(normalize: Any) -> Any:
        def wrapper(m: Any) -> Any:
            t = time.perf_counter()
            try:
                return normalize(m)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapper

    # the reference ledger reads every request from scratch, as before the prefix cache
    leds["window"]._normalize = timed(leds["window"]._normalize)  # type: ignore[method-assign]
    leds["full"]._normalize = timed(normalize_messages)  # type: ignore[method-assign]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant. Answer briefly."},
                                  {"role": "user", "content": "Let us look up some words."}]
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in leds}
    for t in range(turns):
        call = t % 4 == 3
        text = (f'Looking up word {t}.\n<tool_call>\n{{"name": "lookup", "arguments": {{"q": "w{t}"}}}}\n</tool_call>'
                if call else f"Word {t} means thing number {t * 7}.")
        gen = eng.output(text, SamplingParams(), 0)
        if gc_freeze:
            gc.freeze()
        plans, turns_out = {}, {}
        for name in (("window", "full") if t % 2 else ("full", "window")):
            led = leds[name]
            spent[0] = 0.0
            t0 = time.perf_counter()
            p = led.prepare(msgs, TOOLS)
            turns_out[name] = led.commit(p, gen)
            out[name].append((time.perf_counter() - t0, spent[0]))
            plans[name] = (p.mode, p.prompt_ids, p.tail_ids, p.prompt_text)
        if plans["window"] != plans["full"]:
            raise AssertionError(f"turn {t + 1}: the window check planned {plans['window'][0]!r}, "
                                 f"the full render {plans['full'][0]!r} (or different ids)")
        if plans["window"][0] not in ("start", "extend"):
            raise AssertionError(f"turn {t + 1}: {plans['window'][0]} (this session should only extend)")
        msgs = msgs + [wire(turns_out["window"].message())]
        msgs.append({"role": "tool", "content": f"w{t}: a word"} if call else
                    {"role": "user", "content": f"And word {t + 1}?"})
    w, f = leds["window"].render_stats, leds["full"].render_stats
    print(f"extend checks: window ledger {w}, full ledger {f}; {len(msgs)} messages at the end")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--turns", type=int, default=500, help="turns of the session")
    ap.add_argument("--window", type=int, default=20, help="turns per median")
    ap.add_argument("--model", default="builtin:tiny-qwen3", help="model whose tokenizer and chat template render")
    ap.add_argument("--plot", default="runs/bench_ledger.png", help="where to save the plot ('' for none)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() before each turn: the interpreter's cyclic GC then skips the objects of earlier "
                         "turns (separates its heap-size cost from the ledger's own)")
    args = ap.parse_args()
    tok = load_tokenizer(args.model)
    per = session(tok, args.turns, args.gc_freeze)
    k = args.window
    starts = sorted({0, *range(49, args.turns - k + 1, 50), args.turns - k})
    starts = [s for s in starts if 0 <= s <= args.turns - k]

    def med(xs: list[float]) -> float:
        return statistics.median(xs) * 1e3

    print(f"[ledger, {args.model}, {args.turns}-turn session{', gc frozen' if args.gc_freeze else ''}] "
          f"median ms per turn (prepare + commit) over {k} turns")
    print(f"{'turns':>11} | {'full render':>11} | {'window':>8} | {'window: normalize':>17} | {'full/window':>11} | "
          f"{'window, fastest turn':>20}")
    rows = []
    for s in starts:
        f = med([a for a, _ in per["full"][s:s + k]])
        w = med([a for a, _ in per["window"][s:s + k]])
        wn = med([b for _, b in per["window"][s:s + k]])
        wmin = min(a for a, _ in per["window"][s:s + k]) * 1e3
        rows.append((s, f, w, wn, wmin))
        print(f"{s + 1:>5}-{s + k:<5} | {f:11.3f} | {w:8.3f} | {wn:17.3f} | {f / w:10.1f}x | {wmin:20.3f}")
    (s0, f0, w0, n0, m0), (s1, f1, w1, n1, m1) = rows[0], rows[-1]
    print(f"last/first window: full render {f1 / f0:.2f}x, window {w1 / w0:.2f}x "
          f"(window without normalization {(w1 - n1) / (w0 - n0):.2f}x; fastest turn {m1 / m0:.2f}x)")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        xs = range(1, args.turns + 1)
        for name, style in (("full", "tab:red"), ("window", "tab:blue")):
            ax.plot(xs, [a * 1e3 for a, _ in per[name]], ".", ms=2, color=style, alpha=0.35)
            ax.plot([s + k / 2 for s, *_ in rows], [r[1] if name == "full" else r[2] for r in rows], "-o", color=style,
                    label=f"{name} (median of {k} turns)")
        ax.set_xlabel("turn")
        ax.set_ylabel("prepare + commit, ms")
        ax.set_yscale("log")
        ax.set_title("ledger cost per turn: window-checked extend vs full render")
        ax.legend()
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=100)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
