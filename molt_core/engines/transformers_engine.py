"""The embedded rollout engine: a Hugging Face causal LM served with continuous batching by one
worker thread (weight swaps land between decode steps; running rows are re-prefilled under the new
weights), with a prefix cache, per-request seeded sampling through
:func:`molt_core.sampling.processed_logprobs`, and MoE routing records (R3, arXiv 2510.11370).
Design and exactness notes: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import torch

from molt_core.engines.base import WorkerThreadEngine, checked_request
from molt_core.engines.batch_rows import _default_eos_ids, _layers, _lpad, _past_cache, _Request
from molt_core.engines.prefix_cache import PrefixCache
from molt_core.models import cache_keyword, load_model, load_tokenizer, mask_vision_tokens, returned_cache, routing_tool
from molt_core.plugins import modality
from molt_core.sampling import draw_tokens, processed_logprobs
from molt_core.types import GenerationOutput, SamplingParams

__all__ = ["TransformersEngine"]


class TransformersEngine(WorkerThreadEngine):
    """Continuous-batching :class:`~molt_core.engines.base.RolloutEngine` over a ``transformers`` causal LM.

    Args:
        model: a ``PreTrainedModel`` taking ``input_ids`` ``[B, T]`` int64, ``attention_mask`` ``[B, past + T]``,
            ``position_ids`` ``[B, T]``, ``past_key_values`` (a plain ``DynamicCache``), returning ``logits``
            ``[B, T', V]`` and the cache; or a path for :func:`molt_core.models.load_model`.
        tokenizer: decodes completions for stop strings, gives eos ids; loaded from a path ``model``.
            May be None if ``eos_token_ids`` is given and no request uses stop strings.
        max_batch_size: most sequences decoded together (>= 1).
        version: policy version of the initial weights (>= 0).
        eos_token_ids: ids that always end a generation; default from the tokenizer.
        seed: seeds the stream of per-request seeds for requests without ``params.seed``.
        prefix_cache_mb: MiB of finished generations' keys/values kept for a later prompt with the same
            prefix (:mod:`molt_core.engines.prefix_cache`); 0 disables it; off for MoE models.
        vision_processor: the modality plugin's image processor (requests may then carry images); loaded
            from a path ``model``, passed with a model object.
        dtype, gguf_file, model_seed, device: used only when ``model`` is a path (``model_seed``: builtin init).

    Raises:
        ValueError: ``max_batch_size < 1``, ``version < 0``, ``prefix_cache_mb < 0``, or neither
            ``tokenizer`` nor ``eos_token_ids`` given.
    """

    def __init__(
        self,
        model: torch.nn.Module | str,
        tokenizer: Any = None,
        *,
        max_batch_size: int = 64,
        version: int = 0,
        eos_token_ids: list[int] | None = None,
        seed: int | None = None,
        prefix_cache_mb: float = 256,
        dtype: str = "float32",
        gguf_file: str | None = None,
        model_seed: int = 0,
        device: str | None = None,
        vision_processor: Any = None,
    ) -> None:
        self._modality = modality()  # the registered image modality; None: a text-only run
        if isinstance(model, str):
            path = model
            model = load_model(path, dtype=dtype, gguf_file=gguf_file, seed=model_seed)
            if tokenizer is None:
                tokenizer = load_tokenizer(path, gguf_file=gguf_file)
            if vision_processor is None and self._modality is not None:
                vision_processor = self._modality.processor_for(model, path, tokenizer)
        if device is not None:
            model = model.to(device)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {prefix_cache_mb}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.version = int(version)
        self.max_batch_size = int(max_batch_size)
        if eos_token_ids is None:
            if tokenizer is None:
                raise ValueError("give a tokenizer or eos_token_ids: the engine must know its stop ids")
            eos_token_ids = _default_eos_ids(tokenizer)
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        cfg = getattr(model, "config", None)
        self.is_vision = self._modality is not None and self._modality.is_model(model)
        if self.is_vision:  # never sample a vision special token (an image run with no image)
            mask_vision_tokens(model)
        self.vision_processor = vision_processor
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.max_positions = int(getattr(text_cfg, "max_position_embeddings", 1 << 30) or (1 << 30))
        out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.vocab_size = int(out_emb.weight.shape[0]) if out_emb is not None else int(getattr(cfg, "vocab_size", 1 << 62))
        self._seeds = random.Random(seed)
        self.num_steps = 0  # decode/prefill forwards run so far

        self._init_worker(self._loop, "molt-transformers-engine")
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._n_prefill = 0  # admitted requests being prefilled (neither waiting nor running)
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [B, L] int64, 1 on real tokens
        self._stale_cache = False  # weights changed under the running rows' KV cache
        # every state_dict name (tied aliases such as lm_head.weight included) -> live tensor
        self._params = dict(model.state_dict(keep_vars=True))
        self._cache_kw = cache_keyword(model) or "past_key_values"
        tool = routing_tool(model)  # MoE routing record (R3); None for a dense model
        self._routing = tool.recorder(model).attach() if tool is not None else None
        self._last_route: torch.Tensor | None = None  # [B * T, L, K] of the last forward
        self.prefix_cache = PrefixCache(0 if self._routing is not None else int(prefix_cache_mb * 2**20))
        self._worker.start()

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> TransformersEngine:
        """Build an engine from a model path (``builtin:<name>`` or an HF directory); ``kwargs`` as the constructor."""
        return cls(path, **kwargs)

    # ------------------------------------------------------------------ public API
    @property
    def load(self) -> int:
        """Requests in flight (running + waiting): the router's load measure."""
        with self._cv:
            return len(self._running) + len(self._waiting) + self._n_prefill

    async def generate(self, prompt_ids: list[int], params: SamplingParams | dict | None = None,
                       images: list[bytes] | None = None) -> GenerationOutput:
        """Sample a continuation of ``prompt_ids`` under ``params``.

        Args:
            prompt_ids: ``[P]`` ids in ``[0, vocab_size)``, ``1 <= P < max_position_embeddings``; each image's
                placeholder run already expanded.
            params: :class:`SamplingParams` (a dict is validated into one; None = defaults).
            images: encoded bytes of each image run in ``prompt_ids``, in token order (vision models only).

        Returns:
            :class:`GenerationOutput`: ``N`` sampled ids, behaviour logprobs (natural log), per-token
            versions, ``finish_reason`` ``stop``/``length``, ``stop_reason``, ``prompt_len = P``; for an
            MoE model ``routed_experts`` ``[P + N, num_moe_layers, top_k]`` (-1 on the last token).

        Raises:
            ValueError: empty/too long/out-of-range ``prompt_ids``, stop strings without a tokenizer,
                images for a text model, or image runs that do not match ``images``.
            RuntimeError: the engine is closed, or the forward pass failed.
        """
        ids, params = checked_request(prompt_ids, params, self.max_positions, self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("params.stop needs a tokenizer to decode completions; the engine has none")
        vision = self._row_images(ids, images)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        loop = asyncio.get_running_loop()
        req = _Request(ids, params, self.eos_token_ids | frozenset(params.stop_token_ids), gen, loop.create_future(), loop,
                       vision=vision)
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._waiting.append(req)
            self._cv.notify_all()
        return await req.future

    def _row_images(self, ids: list[int], images: list[bytes] | None) -> Any:
        """A prompt's images via the modality's ``row_images``, or None for text. Raises ValueError."""
        if self._modality is None:
            if images:
                raise ValueError(f"{len(images)} image(s) given but no modality plugin is loaded; enable "
                                 "molt_plugins.vision (see docs/vision.md) or send text only")
            return None
        return self._modality.row_images(self.model, self.vision_processor, ids, images, self.is_vision)

    def _vision_kwargs(self, rows: list[_Request], spans: list[tuple[int, int]], n: int,
                       pos2d: torch.Tensor) -> dict[str, Any]:
        """The modality's ``forward_kwargs`` for a left-padded forward over ``rows``; {} without images."""
        if not any(r.vision is not None for r in rows):
            return {}
        return self._modality.forward_kwargs(self.model, [r.vision for r in rows], spans, n, pos2d)

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Copy ``state_dict`` (name -> tensor, any float dtype; partial updates only those) into the model
        between decode steps and stamp later tokens with ``version``. Blocks until applied (any thread
        but the worker).

        Raises:
            KeyError: a name that the model does not have.
            ValueError: a tensor whose shape differs from the model's, or ``version < 0``.
            RuntimeError: the engine is closed.
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        for name, t in state_dict.items():
            if name not in self._params:
                raise KeyError(f"load_weights: the model has no parameter or buffer named {name!r}")
            if tuple(t.shape) != tuple(self._params[name].shape):
                raise ValueError(
                    f"load_weights: {name} has shape {tuple(t.shape)}, the model expects {tuple(self._params[name].shape)}"
                )
        self._queue_weights(state_dict, version)

    def close(self) -> None:
        """Stop the worker; in-flight and waiting requests fail with ``RuntimeError``."""
        self._stop_worker(timeout=30)

    # ------------------------------------------------------------------ worker
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._pending_weights and (
                    self._paused or (not self._waiting and not self._running)
                ):
                    self._cv.wait()
                if self._closed:
                    pending = self._waiting + self._running
                    self._waiting, self._running = [], []
                    weights = self._pending_weights
                    self._pending_weights = []
                    break
                weights = self._pending_weights
                self._pending_weights = []
                admit: list[_Request] = []
                if not self._paused:
                    room = self.max_batch_size - len(self._running)
                    admit, self._waiting = self._waiting[:room], self._waiting[room:]
                    self._n_prefill = len(admit)
            for sd, version, done, err in weights:
                try:
                    with torch.no_grad():
                        for name, t in sd.items():
                            self._params[name].copy_(t)
                    self.version = version
                    self._stale_cache = True
                    self.prefix_cache.clear()  # keys/values of the old weights
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    err.append(e)
                done.set()
            if weights and self._paused:
                continue
            try:
                with torch.inference_mode():
                    if self._stale_cache:
                        if self._running:
                            self._reprefill()
                        self._stale_cache = False
                    admit = [r for r in admit if not r.future.cancelled()]
                    if admit:
                        self._prefill(admit)
                    self._n_prefill = 0
                    if self._running:
                        self._decode()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
                with self._cv:
                    failed = self._running + [r for r in admit if r not in self._running]
                    self._running = []
                self._cache, self._mask, self._n_prefill = None, None, 0
                for r in failed:
                    self._deliver(r, RuntimeError(f"generation failed in the engine: {e!r}"))
        for sd, version, done, err in weights:
            err.append(RuntimeError("the engine is closed"))
            done.set()
        for r in pending:
            self._deliver(r, RuntimeError("the engine was closed before this generation finished"))

    def _forward(self, input_ids, attention_mask, position_ids, cache, vision: dict[str, Any] | None = None):
        """``[B, T]`` ids -> last logits ``[B, V]`` and the cache; MoE: ``_last_route`` ``[B * T, L, K]``."""
        if self._routing is not None:
            self._routing.clear()
        kw = {"position_ids": position_ids, **(vision or {})}
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask,
            use_cache=True, logits_to_keep=1, **kw, **{self._cache_kw: cache},
        )
        self.num_steps += 1
        self._last_route = self._routing.take() if self._routing is not None else None
        new_cache = returned_cache(out)
        return out.logits[:, -1, :], new_cache

    def _prefill(self, reqs: list[_Request]) -> None:
        """Prefill ``reqs`` as one left-padded batch (identical prompts share a row), sample their first
        token, and merge their KV caches into the running batch."""
        first: dict[tuple, int] = {}
        src = [first.setdefault(r.key, len(first)) for r in reqs]
        uniq = [reqs[src.index(j)] for j in range(len(first))]
        hits = [self.prefix_cache.match(r.prompt_ids, r.vision.runs if r.vision is not None else ())
                for r in uniq] if len(self.prefix_cache) else []
        past = max((m for m, _ in hits), default=0)
        suffix = [r.prompt_ids[m:] for r, (m, _) in zip(uniq, hits)] if past else [r.prompt_ids for r in uniq]
        n = max(len(x) for x in suffix)
        ids = torch.zeros(len(uniq), n, dtype=torch.long)
        mask = torch.zeros(len(uniq), n, dtype=torch.long)
        for i, x in enumerate(suffix):
            ids[i, n - len(x):] = torch.tensor(x)
            mask[i, n - len(x):] = 1
        for r in reqs:
            r.next_pos = len(r.prompt_ids)
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = None
        if past:  # reused prefixes, right-aligned in ``past`` columns before the left-padded tails
            cache, pmask = _past_cache(hits, past, self.device)
            mask = torch.cat([pmask, mask], 1)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
        starts = [m for m, _ in hits] if past else [0] * len(uniq)
        vision = self._vision_kwargs(uniq, [(a, len(r.prompt_ids)) for a, r in zip(starts, uniq)], n, pos)
        logits, cache = self._forward(ids, mask, pos, cache, vision)
        if self._last_route is not None:  # [U * n, L, K] -> each row's real (right-aligned) columns
            rt = self._last_route.view(len(uniq), n, *self._last_route.shape[1:])
            for r, j in zip(reqs, src):
                r.routed.append(rt[j, n - len(r.prompt_ids):])
        layers = _layers(cache)
        if len(uniq) < len(reqs):
            expand = torch.tensor(src, device=self.device)
            logits, mask = logits[expand], mask[expand]
            for layer in layers:
                layer.keys, layer.values = layer.keys[expand], layer.values[expand]
        for layer in layers:  # padded slots hold garbage (possibly NaN): zero them
            pad = mask[:, None, :, None] == 0
            layer.keys = layer.keys.masked_fill(pad, 0.0)
            layer.values = layer.values.masked_fill(pad, 0.0)
        self._sample(reqs, logits)
        keep = [i for i, r in enumerate(reqs) if r.finish_reason is None]
        self._remember(reqs, [i for i, r in enumerate(reqs) if r.finish_reason is not None], layers, mask)
        self._deliver_finished(reqs)
        if not keep:
            return
        if len(keep) < len(reqs):
            idx = torch.tensor(keep, device=self.device)
            for layer in layers:
                layer.keys, layer.values = layer.keys[idx], layer.values[idx]
            mask = mask[idx]
        new_rows = [reqs[i] for i in keep]
        if self._cache is None:
            self._cache, self._mask = cache, mask
        else:
            old = _layers(self._cache)
            L = max(self._mask.shape[1], mask.shape[1])
            for a, b in zip(old, layers):
                a.keys = torch.cat([_lpad(a.keys, L, -2), _lpad(b.keys, L, -2)], 0)
                a.values = torch.cat([_lpad(a.values, L, -2), _lpad(b.values, L, -2)], 0)
            self._mask = torch.cat([_lpad(self._mask, L, -1), _lpad(mask, L, -1)], 0)
        with self._cv:
            self._running.extend(new_rows)

    def _reprefill(self) -> None:
        """After a weight swap, recompute every running row's KV cache (``prompt_ids + tokens[:-1]``)."""
        rows = self._running
        ctx = [r.prompt_ids + r.tokens[:-1] for r in rows]
        n = max(len(c) for c in ctx)
        ids = torch.zeros(len(rows), n, dtype=torch.long)
        mask = torch.zeros(len(rows), n, dtype=torch.long)
        for i, c in enumerate(ctx):
            ids[i, n - len(c):] = torch.tensor(c)
            mask[i, n - len(c):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        _, cache = self._forward(ids, mask, pos, None, self._vision_kwargs(rows, [(0, len(c)) for c in ctx], n, pos))
        self._last_route = None
        for layer in _layers(cache):  # padded slots hold garbage (possibly NaN): zero them
            pad = mask[:, None, :, None] == 0
            layer.keys = layer.keys.masked_fill(pad, 0.0)
            layer.values = layer.values.masked_fill(pad, 0.0)
        self._cache, self._mask = cache, mask

    def _decode(self) -> None:
        """One decode step for every running row, then drop finished rows."""
        rows = self._running
        ids = torch.tensor([[r.tokens[-1]] for r in rows], device=self.device)
        pos = torch.tensor([[r.next_pos + r.rope_delta] for r in rows], device=self.device)
        self._mask = torch.cat([self._mask, torch.ones(len(rows), 1, dtype=torch.long, device=self.device)], 1)
        logits, self._cache = self._forward(ids, self._mask, pos, self._cache)
        for i, r in enumerate(rows):
            r.next_pos += 1
            if self._last_route is not None:
                r.routed.append(self._last_route[i:i + 1])
        self._sample(rows, logits)
        keep = [i for i, r in enumerate(rows) if r.finish_reason is None and not r.future.cancelled()]
        if len(keep) == len(rows):
            return
        self._remember(rows, [i for i, r in enumerate(rows) if r.finish_reason is not None], _layers(self._cache),
                       self._mask)
        with self._cv:
            self._running = [rows[i] for i in keep]
        self._deliver_finished(rows)
        if not keep:
            self._cache, self._mask = None, None
            return
        idx = torch.tensor(keep, device=self.device)
        mask = self._mask[idx]
        first = int(mask.any(0).float().argmax())  # leading columns that are padding for every row
        self._mask = mask[:, first:]
        for layer in _layers(self._cache):
            layer.keys = layer.keys[idx, :, first:]
            layer.values = layer.values[idx, :, first:]

    def _remember(self, rows: list[_Request], finished: list[int], layers: list[Any], mask: torch.Tensor) -> None:
        """Put the KV cache of each finished row ``rows[i]``, ``i in finished``, in the prefix cache."""
        if not self.prefix_cache.budget_bytes:
            return
        counts = mask.sum(-1).tolist()
        for i in finished:
            r = rows[i]
            ids = r.prompt_ids + r.tokens[:-1]
            if r.future.cancelled() or int(counts[i]) != len(ids):
                continue
            real = mask[i].bool()
            # left padding: the real columns are the last ones, a slice copy rather than a gather
            cols: Any = slice(mask.shape[1] - len(ids), None) if bool(real[mask.shape[1] - len(ids):].all()) else real
            self.prefix_cache.put(ids, [(layer.keys[i][:, cols].clone(), layer.values[i][:, cols].clone())
                                        for layer in layers], r.vision.runs if r.vision is not None else ())

    def _sample(self, rows: list[_Request], logits: torch.Tensor) -> None:
        """Sample one token per row from ``logits`` ``[B, V]``; finish rows at a stop or a length limit."""
        groups: dict[tuple[float, int, float], list[int]] = {}
        for i, r in enumerate(rows):
            p = r.params
            groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
        version = self.version
        for (temp, top_k, top_p), idx in groups.items():
            lp = processed_logprobs(logits[idx], temp, top_k, top_p)  # [g, V] float32
            toks = lp.argmax(-1) if temp == 0 else draw_tokens(lp, [rows[i].generator for i in idx])
            chosen = lp.gather(-1, toks[:, None]).squeeze(-1).tolist()
            for j, (i, tok) in enumerate(zip(idx, toks.tolist())):
                r = rows[i]
                r.tokens.append(tok)
                r.digest.update((tok,))
                r.logprobs.append(chosen[j])
                r.versions.append(version)
                self._check_stop(r, tok)

    def _check_stop(self, r: _Request, tok: int) -> None:
        p = r.params
        if tok in r.stop_ids:
            r.finish_reason, r.stop_reason = "stop", tok
        elif p.stop:
            text = self.tokenizer.decode(r.tokens, skip_special_tokens=False)
            hit = next((s for s in p.stop if s and s in text), None)
            if hit is not None:
                r.finish_reason, r.stop_reason = "stop", hit
        if r.finish_reason is None and (
            len(r.tokens) >= p.max_tokens or len(r.prompt_ids) + len(r.tokens) >= self.max_positions
        ):
            r.finish_reason = "length"

    def _deliver_finished(self, rows: list[_Request]) -> None:
        """Hand each finished row its :class:`GenerationOutput`, one event-loop wake-up for all."""
        done: list[tuple[_Request, GenerationOutput]] = []
        for r in rows:
            if r.finish_reason is not None:
                done.append((r, GenerationOutput(
                    token_ids=r.tokens, logprobs=r.logprobs, versions=r.versions, finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason, prompt_len=len(r.prompt_ids), routed_experts=self._routed_rows(r),
                    sampled_digest=r.digest.hexdigest(),
                )))
        self._deliver_many(done)

    def _routed_rows(self, r: _Request) -> list[list[list[int]]] | None:
        """``[P + N, L, K]`` routed experts of ``r`` (-1 on the last token), or None for a dense model."""
        if self._routing is None:
            return None
        rows = torch.cat(r.routed).cpu() if r.routed else torch.empty(0, self._routing.num_layers, self._routing.top_k, dtype=torch.long)
        total = len(r.prompt_ids) + len(r.tokens)
        if rows.shape[0] > total:
            raise RuntimeError(f"recorded routing for {rows.shape[0]} positions, but the sequence has {total}")
        pad = torch.full((total - rows.shape[0], *rows.shape[1:]), -1, dtype=torch.long)
        return torch.cat([rows.long(), pad]).tolist()
