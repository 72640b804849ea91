"""Load generator for ``bench_server.py``: closed-loop agent sessions over HTTP, in its own process.

Run as a child process (``python benchmarks/load_client.py``); it reads one JSON job per line
on stdin and writes one JSON result per line on stdout, so the server under test never shares
an interpreter (or its GIL) with the clients that load it. Standard library only.

A job: ``{"wire": "openai" | "anthropic" | "responses", "workers": [[session, ...], ...],
"turns": T, "max_tokens": M}``, where each session is ``{"openai_base_url",
"anthropic_base_url", "api_key"}``. Every worker runs its sessions one after another; each
session is a ``T``-turn conversation (user message, the model's reply appended, next user
message), one request at a time (an agent waits for its answer). All workers run at once, so
``len(workers)`` sessions are in flight. Request ``t`` of session ``s`` of worker ``w`` carries
seed ``w * 10000 + s * 100 + t``, so two runs of the same job sample the same tokens.

A result: ``{"wall_s", "cpu_s", "latencies_s": [...], "tokens": N, "errors": [...], "failed": F,
"turns_lost": L}`` (wall time from the first request sent to the last answer, this process's CPU
time over it, per-request latency in seconds, sampled tokens, the first 5 error messages, the
requests that failed, and the turns not completed because of them: a session ends at its first
failed turn, as an agent's conversation would).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any
from urllib.parse import urlsplit


def user_message(w: int, s: int, t: int) -> str:
    """The ``t``-th user message of session ``s`` of worker ``w`` (also used by the direct peer)."""
    return f"Step {t}: what is {w + s} + {2 * t + 1}?"


def seed_of(w: int, s: int, t: int) -> int:
    """The seed of request ``t`` of session ``s`` of worker ``w``."""
    return w * 10000 + s * 100 + t


class Connection:
    """One keep-alive HTTP/1.1 connection speaking just what the benchmark needs (POST a JSON
    body, read a ``Content-Length`` or chunked answer). ``httpx`` costs about 6 ms of client CPU per
    request, three times the server's own cost: on a shared 2-core machine the clients would
    then measure themselves. This costs well under 1 ms."""

    def __init__(self) -> None:
        self.streams: dict[tuple[str, int], tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

    async def post(self, url: str, headers: dict[str, str], body: Any) -> Any:
        """POST ``body`` as JSON to ``url`` (``http://host:port/path``); returns the decoded JSON
        answer. Raises: RuntimeError on a non-200 status."""
        u = urlsplit(url)
        key = (u.hostname or "127.0.0.1", u.port or 80)
        if key not in self.streams:
            self.streams[key] = await asyncio.open_connection(*key)
        reader, writer = self.streams[key]
        data = json.dumps(body).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(f"POST {u.path} HTTP/1.1\r\nhost: {key[0]}:{key[1]}\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(data)}\r\n{head}\r\n".encode() + data)
        status = await reader.readuntil(b"\r\n\r\n")
        lines = status.decode("latin-1").split("\r\n")
        code = int(lines[0].split()[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
        if "content-length" in fields:
            raw = await reader.readexactly(int(fields["content-length"]))
        else:  # chunked (the router streams what its backend answers)
            parts = []
            while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                parts.append(await reader.readexactly(size))
                await reader.readexactly(2)
            await reader.readuntil(b"\r\n")
            raw = b"".join(parts)
        if code != 200:
            raise RuntimeError(f"HTTP {code} from {url}: {raw[:300]!r}")
        return json.loads(raw)

    def close(self) -> None:
        for _, w in self.streams.values():
            w.close()


async def _request(c: Connection, wire: str, session: dict[str, str], msgs: list[dict[str, str]],
                   max_tokens: int, seed: int) -> tuple[str, int]:
    """One request on ``wire``; returns (reply text, sampled token count). Raises on a non-200."""
    if wire == "openai":
        body = await c.post(session["openai_base_url"] + "/chat/completions",
                            {"authorization": "Bearer " + session["api_key"]},
                            {"model": "m", "messages": msgs, "max_tokens": max_tokens, "seed": seed})
        choice = body["choices"][0]
        return choice["message"]["content"] or "", len(choice["token_ids"])
    if wire == "anthropic":
        body = await c.post(session["anthropic_base_url"] + "/v1/messages", {"x-api-key": session["api_key"]},
                            {"model": "m", "messages": msgs, "max_tokens": max_tokens, "seed": seed})
        return "".join(b.get("text", "") for b in body["content"]), len(body["token_ids"])
    if wire == "responses":
        body = await c.post(session["openai_base_url"] + "/responses", {"authorization": "Bearer " + session["api_key"]},
                            {"model": "m", "input": msgs, "max_output_tokens": max_tokens, "seed": seed})
        text = "".join(p.get("text", "") for item in body["output"] if item.get("type") == "message"
                       for p in item["content"])
        return text, len(body["token_ids"])
    raise ValueError(f"unknown wire {wire!r}; use openai, anthropic or responses")


async def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run one job (see the module docstring) and return its result."""
    lat: list[float] = []
    errors: list[str] = []
    tokens = lost = 0

    async def worker(w: int, sessions: list[dict[str, str]]) -> None:
        nonlocal tokens, lost
        c = Connection()  # one keep-alive connection per agent, as an SDK client keeps
        try:
            for s, session in enumerate(sessions):
                msgs: list[dict[str, str]] = []
                for t in range(job["turns"]):
                    msgs.append({"role": "user", "content": user_message(w, s, t)})
                    t0 = time.perf_counter()
                    try:
                        text, n = await _request(c, job["wire"], session, msgs, job["max_tokens"], seed_of(w, s, t))
                    except Exception as e:  # noqa: BLE001 - reported, the run is then invalid
                        errors.append(f"{type(e).__name__}: {e}")
                        lost += job["turns"] - t + job["turns"] * (len(sessions) - s - 1)
                        return
                    lat.append(time.perf_counter() - t0)
                    tokens += n
                    msgs.append({"role": "assistant", "content": text})
        finally:
            c.close()

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*[worker(w, ss) for w, ss in enumerate(job["workers"])])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall_s": wall, "cpu_s": cpu, "latencies_s": lat, "tokens": tokens, "errors": errors[:5],
            "failed": len(errors), "turns_lost": lost}


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        print(json.dumps(asyncio.run(run_job(json.loads(line)))), flush=True)


if __name__ == "__main__":
    main()
