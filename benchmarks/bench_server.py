"""Loopback server overhead and ledger cost per turn (ratios against a peer measured in the same run).

1. Server overhead: ``--requests`` sequential chat requests (median) over a keep-alive HTTP
   connection through the loopback server (ledger + HTTP + JSON) vs the same prompts sent straight to
   ``engine.generate``; on the builtin tiny Qwen3 engine (stops disabled, ``--max-tokens``
   tokens per request) and on a zero-cost scripted engine (pure server cost per request).
2. Ledger cost per turn over a ``--turns``-turn session (prepare + commit, zero-cost engine):
   mean time of the first and the last 20 turns and their ratio, split into the chat-template
   render (a window of the conversation for a proven template, see benchmarks/bench_ledger.py),
   message normalization (reading the request's messages; the unchanged prefix is compared, not
   re-read) and the ledger's token bookkeeping (tokenizing only the tail, appending the sampled
   ids: this part must not grow with the turn count).

3. Load: closed-loop agent sessions (``--sessions 1,8,50`` in flight; each a ``--load-turns``-turn
   conversation, one request at a time, then the next session) on every wire (OpenAI chat,
   Anthropic messages, OpenAI Responses) against one engine's server and against two engines
   behind the request router (in one process, as ``molt serve --num-engines 2``), and the same
   conversations sent straight to ``engine.generate`` by as many coroutines (the direct peer).
   The clients run in their own process (``load_client.py``), so they do not share the server's
   GIL. Every configuration samples the same tokens (fixed seeds, same prompts), and the
   configurations are interleaved, ``--repeats`` rounds, so machine load hits all alike.
   Reported per configuration: requests/s (median over rounds), sampled tokens/s, p50/p95
   latency (all rounds pooled), sessions that recorded a rewrite and the rewrites per cause
   (read from each session's trajectory after the timed run); and the ratios one engine / two
   engines and server / direct.

Prints tables and writes every figure to ``--json`` (default ``runs/bench_server.json``).

Usage: ``python benchmarks/bench_server.py [--only overhead,load,ledger] [--requests 30] [--max-tokens 16]
[--turns 200] [--sessions 1,8,50] [--wires openai,anthropic,responses] [--repeats 2]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_engine import ScriptedEngine  # noqa: E402

from molt_core.engines.transformers_engine import TransformersEngine  # noqa: E402
from molt_core.ledger import Ledger  # noqa: E402
from molt_core.models import load_model, load_tokenizer  # noqa: E402
from molt_core.server import start_server  # noqa: E402
from molt_core.types import SamplingParams  # noqa: E402


def server_vs_direct(engine, tok, n: int, max_tokens: int) -> tuple[float, float]:
    """Median seconds per request through the server (one fresh session per request, a keep-alive
    HTTP connection of ``load_client.Connection``: the OpenAI SDK's own CPU cost, ~6 ms a
    request, would be counted as the server's) and straight to ``engine.generate`` with the same
    prompt ids and stop ids; the two are interleaved request by request so machine load hits
    both alike."""
    from load_client import Connection

    h = start_server(engine, tok)
    stops = Ledger(tok).stop_token_ids  # the server adds the template's stop ids to every request
    prompts = [[{"role": "user", "content": f"What is {i} + {2 * i}?"}] for i in range(n)]
    ids = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
           for m in prompts]
    loop = asyncio.new_event_loop()
    conn = Connection()
    t_server, t_direct = [], []

    def post(info, msgs, **kw):
        return loop.run_until_complete(conn.post(info.openai_base_url + "/chat/completions",
                                                 {"authorization": "Bearer " + info.api_key},
                                                 {"model": "m", "messages": msgs, **kw}))

    try:
        post(h.create_session(), prompts[0], max_tokens=2)  # warm-up
        sessions = [h.create_session() for _ in prompts]  # made before the clock starts
        for i, (info, msgs) in enumerate(zip(sessions, prompts)):
            t0 = time.perf_counter()
            got = post(info, msgs, max_tokens=max_tokens, seed=i)
            t1 = time.perf_counter()
            out = loop.run_until_complete(engine.generate(ids[i], SamplingParams(max_tokens=max_tokens, seed=i,
                                                                                 stop_token_ids=stops)))
            t2 = time.perf_counter()
            assert got["choices"][0]["token_ids"] == out.token_ids or not isinstance(engine, TransformersEngine)
            t_server.append(t1 - t0)
            t_direct.append(t2 - t1)
    finally:
        conn.close()
        h.stop()
        loop.close()
    return statistics.median(t_server), statistics.median(t_direct)

class LoadClient:
    """The load generator (``load_client.py``) in a child process: ``run(job)`` sends one job and
    returns its result dict (failed requests counted in ``failed`` / ``turns_lost``, not raised)."""

    def __init__(self) -> None:
        import subprocess

        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("load_client.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        if out["errors"]:
            print(f"  load client: {out['failed']} request(s) failed, {out['turns_lost']} turn(s) lost; first: "
                  f"{out['errors'][:2]}", flush=True)
        return out

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def direct_load(engine, tok, workers: int, convs: int, turns: int, max_tokens: int) -> dict:
    """The direct peer of a load run: ``workers`` coroutines each run ``convs`` conversations of
    ``turns`` turns straight on ``engine.generate`` -- the same user messages, seeds and stop ids
    as the server's sessions; each next prompt extends the last one by the sampled ids and the
    template's tail (as the ledger does), so no server, ledger or HTTP work is timed."""
    from load_client import seed_of, user_message

    stops = Ledger(tok).stop_token_ids
    enc = partial(tok.encode, add_special_tokens=False)
    lat: list[float] = []
    tokens = 0

    async def worker(w: int) -> None:
        nonlocal tokens
        for s in range(convs):
            ids: list[int] = []
            for t in range(turns):
                tail = ("" if not ids or ids[-1] in stops else "<|im_end|>") + ("\n" if ids else "")
                ids = ids + enc(tail + f"<|im_start|>user\n{user_message(w, s, t)}<|im_end|>\n<|im_start|>assistant\n")
                t0 = time.perf_counter()
                out = await engine.generate(ids, SamplingParams(max_tokens=max_tokens, seed=seed_of(w, s, t),
                                                                stop_token_ids=stops))
                lat.append(time.perf_counter() - t0)
                tokens += len(out.token_ids)
                ids = ids + out.token_ids

    async def main() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(w) for w in range(workers)])
        return time.perf_counter() - t0

    wall = asyncio.run(main())
    return {"wall_s": wall, "latencies_s": lat, "tokens": tokens, "errors": [], "failed": 0, "turns_lost": 0}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def load_bench(model: str, sessions: list[int], wires: list[str], turns: int, requests: int, max_tokens: int,
               repeats: int, max_batch_size: int, prefix_cache_mb: float = 256,
               fronts_run: tuple[int, ...] = (0, 1, 2)) -> list[dict]:
    """Run every load configuration ``repeats`` times, interleaved; returns one row per
    configuration of ``fronts_run`` (1: one engine's server, 2: two engines behind the router, 0: the
    direct peer): ``sessions``, ``engines``, ``wire``,
    ``req_per_s`` (median over rounds), ``tokens_per_s``, ``p50_ms``, ``p95_ms``, ``requests``,
    ``server_cpu_ms_per_req`` (CPU time of this process -- engines, servers, router; for the
    direct peer the engine and its coroutines -- per request: robust to machine load, unlike
    wall time), ``client_cpu_ms_per_req`` (the load client's process), ``failed`` (requests that
    got an error) and ``turns_lost`` (turns not completed because of one)."""
    import httpx

    from molt_core.cli.router import start_router

    tok = load_tokenizer(model)
    engines = [TransformersEngine(load_model(model), tok, max_batch_size=max_batch_size, eos_token_ids=[],
                                  prefix_cache_mb=prefix_cache_mb) for _ in range(2)]
    servers = [start_server(e, tok) for e in engines]
    router = start_router(servers)
    fronts = {k: f for k, f in {1: servers[0], 2: router}.items() if k in fronts_run}
    client = LoadClient()
    runs: dict[tuple, list[dict]] = {}
    try:
        admin = httpx.Client(timeout=60)  # one client: httpx.post builds an SSL context per call

        def session(front) -> dict:
            r = admin.post(front.base_url + "/sessions", json={}, headers={"x-api-key": front.admin_key})
            r.raise_for_status()
            return r.json()

        def job(front, wire: str, n: int, convs: int) -> dict:
            return {"wire": wire, "turns": turns, "max_tokens": max_tokens,
                    "workers": [[session(front) for _ in range(convs)] for _ in range(n)]}

        def run_load(front, wire: str, n: int, convs: int) -> dict:
            """One timed load run, then (untimed) each session's rewrites per cause from its trajectory."""
            j = job(front, wire, n, convs)
            out = timed(client.run, j)
            causes: dict[str, int] = {}
            out["rewrite_sessions"] = 0
            for s in (s for w in j["workers"] for s in w):
                r = admin.get(f"{front.base_url}/sessions/{s['session_id']}/trajectory",
                              headers={"x-api-key": front.admin_key})
                r.raise_for_status()
                info = r.json()["info"]
                out["rewrite_sessions"] += info["requests"]["rewrite"] > 0
                for c, k in info["rewrite_causes"].items():
                    causes[c] = causes.get(c, 0) + k
            out["rewrite_causes"] = causes
            return out

        for front in fronts.values():  # warm-up: every engine, both paths
            client.run(job(front, "openai", 2, 1))
        direct_load(engines[0], tok, 2, 1, 2, 4)
        def timed(fn, *a) -> dict:  # this process's CPU time (engines + servers + router) over the run
            c0 = time.process_time()
            out = fn(*a)
            return {**out, "server_cpu_s": time.process_time() - c0}

        for r in range(repeats):
            for n in sessions:
                convs = max(1, -(-requests // (n * turns)))
                if 0 in fronts_run:
                    runs.setdefault((n, 0, "direct"), []).append(
                        timed(direct_load, engines[0], tok, n, convs, turns, max_tokens))
                for wire in wires:
                    for k, front in fronts.items():
                        runs.setdefault((n, k, wire), []).append(run_load(front, wire, n, convs))
                print(f"  round {r + 1}/{repeats}: {n} sessions done", flush=True)
    finally:
        client.close()
        router.stop()
        for h in servers:
            h.stop()
        for e in engines:
            e.close()
    rows = []
    for (n, k, wire), rs in runs.items():
        lat = [x for res in rs for x in res["latencies_s"]]
        rows.append({"sessions": n, "engines": k, "wire": wire, "rounds": len(rs), "requests": len(lat),
                     "req_per_s": statistics.median(len(res["latencies_s"]) / res["wall_s"] for res in rs),
                     "tokens_per_s": statistics.median(res["tokens"] / res["wall_s"] for res in rs),
                     "p50_ms": statistics.median(lat) * 1e3, "p95_ms": _pct(lat, 0.95) * 1e3,
                     "server_cpu_ms_per_req": sum(res["server_cpu_s"] for res in rs) / len(lat) * 1e3,
                     "client_cpu_ms_per_req": sum(res.get("cpu_s", 0.0) for res in rs) / len(lat) * 1e3,
                     "rewrite_sessions": sum(res.get("rewrite_sessions", 0) for res in rs),
                     "failed": sum(res["failed"] for res in rs), "turns_lost": sum(res["turns_lost"] for res in rs),
                     "sessions_run": sum(len(res["latencies_s"]) for res in rs) // turns,
                     "rewrite_causes": {c: sum(res.get("rewrite_causes", {}).get(c, 0) for res in rs)
                                        for c in sorted({c for res in rs for c in res.get("rewrite_causes", {})})}})
    return rows


def print_load(rows: list[dict]) -> list[dict]:
    """Print the load table and the ratios; returns the ratio rows (one engine / two engines,
    server / direct peer, per sessions and wire)."""
    by = {(r["sessions"], r["engines"], r["wire"]): r for r in rows}
    print(f"{'sessions':>8} {'engines':>8} {'wire':>10} {'req/s':>8} {'tok/s':>8} {'p50 ms':>8} {'p95 ms':>8} "
          f"{'cpu ms/req':>10} {'client cpu':>10}")
    for r in sorted(rows, key=lambda r: (r["sessions"], r["wire"] != "direct", r["wire"], r["engines"])):
        k = "direct" if r["engines"] == 0 else str(r["engines"])
        print(f"{r['sessions']:>8} {k:>8} {r['wire']:>10} {r['req_per_s']:8.1f} {r['tokens_per_s']:8.0f} "
              f"{r['p50_ms']:8.0f} {r['p95_ms']:8.0f} {r['server_cpu_ms_per_req']:10.2f} {r['client_cpu_ms_per_req']:10.2f}")
    for r in rows:
        if r["failed"]:
            print(f"  ERRORS, {r['sessions']} sessions, {r['engines']} engine(s), {r['wire']}: {r['failed']} request(s) "
                  f"failed, {r['turns_lost']} of {r['requests'] + r['turns_lost']} turns lost")
        if r["engines"] and r["rewrite_sessions"]:
            print(f"  rewrites, {r['sessions']} sessions, {r['engines']} engine(s), {r['wire']}: {r['rewrite_sessions']} of "
                  f"{r['sessions_run']} sessions; causes {({c: k for c, k in r['rewrite_causes'].items() if k})}")
    ratios = []
    for (n, k, wire), r in sorted(by.items()):
        if k != 1:
            continue
        two, direct = by.get((n, 2, wire)), by.get((n, 0, "direct"))
        if not (two or direct):
            continue
        ratios.append({"sessions": n, "wire": wire,
                       "one_over_two_engines": r["req_per_s"] / two["req_per_s"] if two else None,
                       "server_over_direct": r["req_per_s"] / direct["req_per_s"] if direct else None,
                       "cpu_server_over_direct": (r["server_cpu_ms_per_req"] / direct["server_cpu_ms_per_req"]
                                                  if direct else None)})
    print("requests/s ratios: one engine / two engines behind the router (target >= 0.7 at 50 sessions); "
          "one engine's server / direct engine calls; CPU per request, server process / direct")
    for x in ratios:
        f = {k: "n/a" if v is None else f"{v:.2f}x" for k, v in x.items() if k not in ("sessions", "wire")}
        print(f"  {x['sessions']:>3} sessions {x['wire']:>10}: one/two {f['one_over_two_engines']}   "
              f"server/direct {f['server_over_direct']}   cpu server/direct {f['cpu_server_over_direct']}")
    return ratios


def ledger_turns(tok, turns: int) -> list[tuple[float, float, float]]:
    """(total, template render, message normalization) seconds of prepare + commit for each
    turn of one session."""
    led = Ledger(tok)
    eng = ScriptedEngine(tok)
    spent = {"render": 0.0, "normalize": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
        return wrapper

    led.render = timed("render", led.render)  # type: ignore[method-assign]
    led._render_window = timed("render", led._render_window)  # type: ignore[method-assign]
    led._normalize = timed("normalize", led._normalize)  # type: ignore[method-assign]
    msgs: list[dict] = []
    out = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Step {t}: the tool said {t * 7}."})
        gen = eng.output(f"Noted step {t}.", SamplingParams(), 0)
        spent.update(render=0.0, normalize=0.0)
        t0 = time.perf_counter()
        p = led.prepare(msgs)
        turn = led.commit(p, gen)
        out.append((time.perf_counter() - t0, spent["render"], spent["normalize"]))
        assert p.mode in ("start", "extend")
        msgs.append({"role": "assistant", "content": turn.content})
    from molt_core.identity import check_tokens

    assert check_tokens(led.trajectory()).retokenized == 0 and len(led.segments()) == 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--only", default="overhead,load,ledger", help="sections to run, comma-separated, of: overhead, load, ledger")
    ap.add_argument("--requests", type=int, default=30, help="sequential requests of the overhead section")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens sampled per request")
    ap.add_argument("--turns", type=int, default=200, help="turns of the ledger section's session")
    ap.add_argument("--sessions", default="1,8,50", help="sessions in flight, per load run")
    ap.add_argument("--wires", default="openai,anthropic,responses", help="wires of the load runs, comma-separated")
    ap.add_argument("--load-turns", type=int, default=4, help="turns of each load session")
    ap.add_argument("--load-requests", type=int, default=120, help="about this many requests per load run")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds of the load runs")
    ap.add_argument("--max-batch-size", type=int, default=64, help="the load engines' max_batch_size")
    ap.add_argument("--prefix-cache-mb", type=float, default=256, help="the load engines' prefix cache (0: off)")
    ap.add_argument("--fronts", default="direct,1,2", help="load configurations, comma-separated, of: direct (engine "
                    "calls), 1 (one engine's server), 2 (two engines behind the router)")
    ap.add_argument("--model", default="builtin:tiny-qwen3", help="the engines' model")
    ap.add_argument("--json", default="runs/bench_server.json", help="where to write every figure")
    args = ap.parse_args()
    only = set(args.only.split(","))
    torch.set_num_threads(1)
    tok = load_tokenizer(args.model)
    report: dict = {"model": args.model, "max_tokens": args.max_tokens, "torch_threads": 1}

    if "overhead" in only:
        # no prefix cache: the direct call would reuse the server request's keys/values (same prompt)
        eng = TransformersEngine(load_model(args.model), tok, max_batch_size=4, eos_token_ids=[], prefix_cache_mb=0)
        s, d = server_vs_direct(eng, tok, args.requests, args.max_tokens)
        eng.close()
        print(f"[{args.model}, {args.max_tokens} tokens/request] server {s * 1e3:.1f} ms/request, direct engine "
              f"{d * 1e3:.1f} ms/request: ratio {s / d:.3f}x (target <= 1.05), overhead {(s - d) * 1e3:.1f} ms/request")
        s0, d0 = server_vs_direct(ScriptedEngine(tok, ["x" * 8] * (args.requests + 1)), tok, args.requests,
                                  args.max_tokens)
        print(f"[zero-cost engine] server {s0 * 1e3:.2f} ms/request, direct {d0 * 1e3:.3f} ms/request: "
              f"pure server cost {(s0 - d0) * 1e3:.2f} ms/request")
        report["overhead"] = {"server_ms": s * 1e3, "direct_ms": d * 1e3, "ratio": s / d,
                              "zero_cost_server_ms": s0 * 1e3, "zero_cost_direct_ms": d0 * 1e3}

    if "load" in only:
        sessions = [int(x) for x in args.sessions.split(",")]
        print(f"[load, {args.model}, {args.max_tokens} tokens/request, {args.load_turns}-turn sessions, "
              f"max_batch_size {args.max_batch_size}, prefix cache {args.prefix_cache_mb:g} MiB, {args.repeats} interleaved rounds]")
        rows = load_bench(args.model, sessions, args.wires.split(","), args.load_turns, args.load_requests,
                          args.max_tokens, args.repeats, args.max_batch_size, args.prefix_cache_mb,
                          tuple(0 if f == "direct" else int(f) for f in args.fronts.split(",")))
        report["load"] = {"rows": rows, "ratios": print_load(rows), "turns": args.load_turns,
                          "max_batch_size": args.max_batch_size, "prefix_cache_mb": args.prefix_cache_mb}

    if "ledger" in only:
        per = ledger_turns(tok, args.turns)
        k = min(20, args.turns // 2)

        def mean(xs):
            return statistics.median(xs) * 1e3

        rows = {"total (prepare + commit)": [a for a, _, _ in per],
                "chat-template render": [b for _, b, _ in per],
                "message normalization": [c for _, _, c in per],
                "ledger token bookkeeping": [a - b - c for a, b, c in per]}
        print(f"[ledger, {args.turns}-turn session] median ms per turn, first {k} vs last {k} turns:")
        report["ledger"] = {}
        for name, xs in rows.items():
            f, last = mean(xs[:k]), mean(xs[-k:])
            print(f"  {name:<26} {f:8.3f} vs {last:8.3f}  ratio {last / f:6.2f}x")
            report["ledger"][name] = {"first_ms": f, "last_ms": last}

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    failed = sum(r["failed"] for r in report.get("load", {}).get("rows", []))
    if failed:
        sys.exit(f"load: {failed} request(s) failed (see ERRORS above)")


if __name__ == "__main__":
    main()
