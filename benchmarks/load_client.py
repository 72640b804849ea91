"""Load generator for ``bench_server.py``: closed-loop agent sessions over HTTP, in its own process.

Run as a child process (``python benchmarks/load_client.py``); it reads one JSON job per line
on stdin and writes one JSON result per line on stdout, so the server under test never shares
an interpreter (or its GIL) with the clients that load it. It imports only ``httpx``.

A job: ``{"wire": "openai" | "anthropic" | "responses", "workers": [[session, ...], ...],
"turns": T, "max_tokens": M}``, where each session is ``{"openai_base_url",
"anthropic_base_url", "api_key"}``. Every worker runs its sessions one after another; each
session is a ``T``-turn conversation (user message, the model's reply appended, next user
message), one request at a time (an agent waits for its answer). All workers run at once, so
``len(workers)`` sessions are in flight. Request ``t`` of session ``s`` of worker ``w`` carries
seed ``w * 10000 + s * 100 + t``, so two runs of the same job sample the same tokens.

A result: ``{"wall_s", "latencies_s": [...], "tokens": N, "errors": [...]}`` (wall time from
the first request sent to the last answer, per-request latency in seconds, sampled tokens).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import httpx


def user_message(w: int, s: int, t: int) -> str:
    """The ``t``-th user message of session ``s`` of worker ``w`` (also used by the direct peer)."""
    return f"Step {t}: what is {w + s} + {2 * t + 1}?"


def seed_of(w: int, s: int, t: int) -> int:
    """The seed of request ``t`` of session ``s`` of worker ``w``."""
    return w * 10000 + s * 100 + t


async def _request(c: httpx.AsyncClient, wire: str, session: dict[str, str], msgs: list[dict[str, str]],
                   max_tokens: int, seed: int) -> tuple[str, int]:
    """One request on ``wire``; returns (reply text, sampled token count). Raises on a non-200."""
    if wire == "openai":
        r = await c.post(session["openai_base_url"] + "/chat/completions",
                         headers={"authorization": "Bearer " + session["api_key"]},
                         json={"model": "m", "messages": msgs, "max_tokens": max_tokens, "seed": seed})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return choice["message"]["content"] or "", len(choice["token_ids"])
    if wire == "anthropic":
        r = await c.post(session["anthropic_base_url"] + "/v1/messages", headers={"x-api-key": session["api_key"]},
                         json={"model": "m", "messages": msgs, "max_tokens": max_tokens, "seed": seed})
        r.raise_for_status()
        body = r.json()
        return "".join(b.get("text", "") for b in body["content"]), len(body["token_ids"])
    if wire == "responses":
        r = await c.post(session["openai_base_url"] + "/responses",
                         headers={"authorization": "Bearer " + session["api_key"]},
                         json={"model": "m", "input": msgs, "max_output_tokens": max_tokens, "seed": seed})
        r.raise_for_status()
        body = r.json()
        text = "".join(p.get("text", "") for item in body["output"] if item.get("type") == "message"
                       for p in item["content"])
        return text, len(body["token_ids"])
    raise ValueError(f"unknown wire {wire!r}; use openai, anthropic or responses")


async def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run one job (see the module docstring) and return its result."""
    lat: list[float] = []
    errors: list[str] = []
    tokens = 0
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:

        async def worker(w: int, sessions: list[dict[str, str]]) -> None:
            nonlocal tokens
            for s, session in enumerate(sessions):
                msgs: list[dict[str, str]] = []
                for t in range(job["turns"]):
                    msgs.append({"role": "user", "content": user_message(w, s, t)})
                    t0 = time.perf_counter()
                    try:
                        text, n = await _request(c, job["wire"], session, msgs, job["max_tokens"], seed_of(w, s, t))
                    except Exception as e:  # noqa: BLE001 - reported, the run is then invalid
                        errors.append(f"{type(e).__name__}: {e}")
                        return
                    lat.append(time.perf_counter() - t0)
                    tokens += n
                    msgs.append({"role": "assistant", "content": text})

        t0 = time.perf_counter()
        await asyncio.gather(*[worker(w, ss) for w, ss in enumerate(job["workers"])])
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "latencies_s": lat, "tokens": tokens, "errors": errors[:5]}


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        print(json.dumps(asyncio.run(run_job(json.loads(line)))), flush=True)


if __name__ == "__main__":
    main()
