"""The session ledger: the single place where trajectories are assembled, token-exactly.

Token identity (invariant 1, docs/README.md): the trainer trains on the ids the engine sampled,
never on a re-tokenized transcript. Per session (one rollout) the :class:`Ledger` holds the
token context the engine actually saw and produced. Each request of the session is decided
by :meth:`Ledger.prepare` (pure) and recorded by :meth:`Ledger.commit` (atomic):

* **extend** -- the request repeats, message for message, the history the ledger committed
  (the earlier requests plus the assistant messages it returned: as committed, or exactly as
  the wire sent them -- matched against the stored reply of that turn, never re-tokenized;
  its reasoning may be left out, nothing else may differ: whitespace, a call id, an
  argument's type or key order all count), and the chat template does
  not rewrite that history once the new messages follow. The engine prompt is then the exact
  ids the ledger holds (earlier sampled ids included, never re-encoded) + the tokenized
  *tail*: the template's close of the last assistant turn after the sampled stop token (the
  ``"\\n"`` after ``<|im_end|>``; the whole ``<|im_end|>\\n`` when the generation ended
  without it) followed by the rendering of every new message and the generation prompt.
  Only template and new-message text is tokenized. The check renders only a window of the
  conversation (its first messages and its last few) when the chat template is proven
  window-local (:mod:`molt_core.ledger.render`): the same verdict and tail as rendering the
  whole conversation, at a cost that does not grow with the turn count; any other template,
  or a window that does not pass, takes the full render. Reading a request reuses the
  previous request's normalized messages for the unchanged prefix
  (:class:`~molt_core.ledger.messages.NormalizeCache`).
* **rewrite** -- anything else (context compaction, an edited history, a template that
  re-renders history such as Qwen3 dropping earlier ``<think>`` blocks once a new user turn
  follows, B03): the open segment is sealed and a new one starts from the full render; the
  cause is counted (:data:`REWRITE_CAUSES`, ``info["rewrite_causes"]``).
* **start** -- the first request of the session.
* **retry** -- the same messages, tools and sampling settings as the last committed request:
  answered from the cached turn, nothing recorded twice.

Template/prompt tokens carry ``loss_mask=False``; sampled tokens ``True``, their behaviour
logprob, policy version and a :class:`~molt_core.types.SampledSpan` with the sampling
transform and the engine's record of the ids it sampled (``digest``, ``sampled_ids``), which
the trainer's ingress checks every action token against (:mod:`molt_core.identity`). All
segments share the session's ``rollout_id``. Generated text is never re-encoded into action
tokens. On a *rewrite* the earlier history, held as ids until then, is re-encoded from text as
context of the new segment (never trained on); those tokens are counted in the ledger-owned
``info["context_reencoded_tokens"]``. A generation cut by ``max_tokens`` (finish reason
``length``) marks the trajectory ``truncated``, whatever the agent did next.

Images (vision-language models): a user or tool message may carry image parts (the
internal part, read by the modality plugin's ``decode_part``). The template renders one placeholder
per image; the ledger's ``vision`` (the model's image processor, from the modality plugin) expands
each into the run of image tokens the engine sees (its ``expand``), and the segment records one
:class:`~molt_core.types.ImageRef` per run -- in a tail too, so images may arrive in any turn.
An extension compares the earlier turns' images by SHA-256 and keeps their expanded ids as
held; a template that rewrites an earlier image turn takes the rewrite path like text. Each
distinct image's bytes are held once per rollout (a pool keyed by SHA-256, however many turns
show it); ``Prepared.images`` hands the engine the prompt's images in token order and
``Trajectory.images`` stores each once.

The framework-owned Env loop calls ``prepare`` / ``engine.generate`` / ``commit`` directly;
the loopback server (:mod:`molt_core.server`) does the same per HTTP request.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

from molt_core.engines.base import GenerationOutput
from molt_core.ledger.messages import NormalizeCache, image_shas, normalize_messages
from molt_core.ledger.render import WindowMessages, WindowProof, prove_window, window_start
from molt_core.ledger.parsers import HermesParser, ToolParser, get_tool_parser
from molt_core.types import ImageRef, SampledSpan, SamplingParams, Segment, Trajectory, new_id

__all__ = ["LEDGER_INFO_KEYS", "REWRITE_CAUSES", "Ledger", "Prepared", "AssistantTurn", "LedgerConflict", "PromptTooLong",
           "normalize_messages", "max_token_bytes"]

#: ``Trajectory.info`` keys the ledger owns: an agent's ``info`` never overwrites them
LEDGER_INFO_KEYS = ("requests", "context_reencoded_tokens", "length_cut_turns", "rewrite_causes")

#: why a request could not extend the open segment (``Prepared.cause``, counted per rollout in
#: ``info["rewrite_causes"]``): ``reply_edited`` -- an assistant message the ledger returned
#: comes back neither as committed nor as the reply the wire sent (content to the whitespace,
#: reasoning unless left out, call ids, names and argument JSON text: :func:`_echoes_reply`);
#: ``history_edited`` -- another message differs, or the request holds fewer messages than
#: the history (compaction, an edit, a new sample of an earlier prompt); ``tools_changed``;
#: ``template_rewrites_history`` -- the request echoes the history but the chat template
#: renders it differently once the new messages follow (Qwen3 dropping earlier ``<think>``
#: blocks, B03) or renders the last turn other than as the previous prompt + reply + turn
#: close; ``template_unprobed`` -- the template's assistant turn could not be probed
REWRITE_CAUSES = ("reply_edited", "history_edited", "tools_changed", "template_rewrites_history", "template_unprobed")

_PROBE_USER = "molt-ledger-probe-user"
_PROBE_ASSISTANT = "molt-ledger-probe-assistant"


class LedgerConflict(RuntimeError):
    """A :class:`Prepared` was committed after another request changed the ledger."""


class PromptTooLong(ValueError):
    """The prompt does not fit the context: ``tokens`` (exact, or a lower bound when
    ``estimated``) >= ``limit``."""

    def __init__(self, message: str, tokens: int, limit: int, estimated: bool) -> None:
        super().__init__(message)
        self.tokens, self.limit, self.estimated = tokens, limit, estimated


_MAX_TOKEN_BYTES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes (hence characters) of text any one token of
    ``tokenizer`` stands for: the longest vocabulary entry (added tokens included) in UTF-8
    bytes -- a byte-level BPE entry spells each byte as one character of 1-2 bytes, a
    SentencePiece entry its text with ``\u2581`` for a space, a byte-fallback entry
    ``<0xNN>`` one byte. So a text of ``c`` characters is at least ``ceil(c / bound)`` tokens
    (cached per tokenizer; 2**20 -- no cheap rejection -- when the vocabulary cannot be read)."""
    try:
        return _MAX_TOKEN_BYTES[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        bound = max(len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()) or 1 << 20
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary
        bound = 1 << 20
    try:  # cached per tokenizer object (never by id: a freed tokenizer's id is reused)
        _MAX_TOKEN_BYTES[tokenizer] = bound
    except TypeError:  # not weak-referenceable: computed each time
        pass
    return bound


# --------------------------------------------------------------------------- messages


def _chat_form(m: dict[str, Any]) -> dict[str, Any]:
    """A message as the compiled template sees it (``reasoning_content`` also as ``thinking``)."""
    return {"thinking": m["reasoning_content"], **m} if "reasoning_content" in m else m


def _calls(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(id, name, arguments as JSON text)`` per tool call of normalized message ``m``. Text,
    not the parsed dict: Python's ``==`` takes ``1``, ``1.0`` and ``true`` for one value and
    ignores key order, while a chat template renders each differently (``tojson``);
    ``json.dumps`` spells them apart and keeps the model's key order."""
    return [(c["id"], c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
            for c in m.get("tool_calls", ())]


def _same_json(a: Any, b: Any) -> bool:
    """``a == b`` and the same JSON text (``1``, ``1.0`` and ``true`` apart, key order counts;
    see :func:`_calls`): tool schemas, which the template renders with ``tojson``."""
    return a == b and json.dumps(a, ensure_ascii=False) == json.dumps(b, ensure_ascii=False)


def _same_messages(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Normalized message lists ``a == b`` field for field (content with its whitespace and
    think block, ``reasoning_content``, ``name``, ``tool_call_id``, call ids), tool-call
    arguments compared as JSON text (:func:`_calls`; skipped for one object twice -- the
    :class:`~molt_core.ledger.messages.NormalizeCache` hands back the previous request's
    objects for an unchanged prefix, so a request costs in proportion to its new messages)."""
    return a == b and all(x is y or _calls(x) == _calls(y) for x, y in zip(a, b) if "tool_calls" in x)


#: a committed turn's reply as the wires sent it: content, reasoning (None: none) and
#: :func:`_calls` of its tool calls
_Reply = tuple[str, str | None, list[tuple[str, str, str]]]

_REPLY_KEYS = frozenset(("role", "content", "reasoning_content", "tool_calls"))


def _echoes_reply(reply: _Reply, m: dict[str, Any]) -> bool:
    """``m`` (a normalized request message) is the assistant reply ``reply`` the wire sent,
    returned as received: the same content (exactly), the same reasoning or none (a client
    need not echo it: the ledger holds what the model produced), the same tool calls
    (:func:`_calls`, ids included) and no other field -- compared with the stored reply, never
    re-derived from the committed text (an unclosed ``<think>`` leaves the reply's content
    empty; issue 24 item 9). Any edit (whitespace, reasoning, an argument's type or key order)
    is no echo."""
    return (m["role"] == "assistant" and m["content"] == reply[0] and m.keys() <= _REPLY_KEYS
            and m.get("reasoning_content") in (None, reply[1]) and _calls(m) == reply[2])


def _call_id(prompt_ids: list[int], sampled_ids: list[int], k: int) -> str:
    """The id of tool call ``k`` (0-based) of the turn that sampled ``sampled_ids`` after
    ``prompt_ids``: ``"call_"`` + the first 24 hex digits of SHA-256 of
    ``"<prompt ids>|<sampled ids>|<k>"`` (ids comma-separated). A function of the tokens, never
    random: a template that renders ids (Mistral's ``call_id``) puts the same tokens in the
    next prompt on every run, so a resumed run samples what the uninterrupted one did."""
    key = f"{','.join(map(str, prompt_ids))}|{','.join(map(str, sampled_ids))}|{k}"
    return "call_" + hashlib.sha256(key.encode()).hexdigest()[:24]


# --------------------------------------------------------------------------- results


@dataclass
class AssistantTurn:
    """One generation, parsed into a chat message; ``token_ids`` / ``logprobs`` are exact.

    ``content``: visible text (no think block, no tool-call blocks, stop string/token
    removed). ``reasoning``: the think block's text or None. ``tool_calls``: ``[{"id",
    "name", "arguments": dict}]`` parsed by the ledger's tool parser (:mod:`molt_core.ledger.parsers`,
    default Hermes ``<tool_call>{json}</tool_call>``; malformed blocks stay in ``content``). ``raw``: the assistant
    turn's body as the model produced it (generation-prompt body prefix + sampled text,
    tool-call blocks removed) -- what the ledger's history holds. ``finish_reason``:
    ``stop`` / ``length`` / ``abort`` / ``tool_calls``. ``stop_sequence``: the stop string
    that ended it. ``prompt_len``: engine prompt length in tokens.
    """

    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    raw: str
    finish_reason: str
    stop_sequence: str | None
    token_ids: list[int]
    logprobs: list[float]
    prompt_len: int

    def message(self) -> dict[str, Any]:
        """The assistant message in canonical OpenAI form (as stored in the ledger history)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.raw}
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in self.tool_calls]
        return msg



def expand_images(vision: Any, ids: list[int], shas: list[str], pool: dict[str, bytes],
                  offset: int) -> tuple[list[int], list[ImageRef]]:
    """``ids`` with each image placeholder expanded into its run and the runs' refs (``vision.expand``);
    ``(ids, [])`` for a text-only model and no images.

    Raises:
        ValueError: images and no vision processor, or as ``vision.expand``.
    """
    if vision is None:
        if shas:
            raise ValueError(f"the messages carry {len(shas)} image(s) but this model has no vision processor; "
                             "serve a vision-language model (see docs/vision.md) or send text only")
        return ids, []
    return vision.expand(ids, shas, pool, offset)


def extra_image_tokens(vision: Any, shas: list[str], pool: dict[str, bytes]) -> int:
    """Tokens the images ``shas`` add to a render by expansion (``vision.extra_tokens``); 0 for none."""
    return vision.extra_tokens(shas, pool) if vision is not None and shas else 0

@dataclass
class Prepared:
    """The plan for one request (from :meth:`Ledger.prepare`; nothing mutated yet).

    ``mode``: start / extend / rewrite / retry. ``prompt_ids``: the ids to send to the engine
    (extend: the open segment's exact ids + ``tail_ids``). ``tail_ids``: what is appended to
    the segment before the sampled ids (start/rewrite: the whole prompt). ``cached``: the
    earlier :class:`AssistantTurn` on retry. ``reencoded``: on a rewrite, the tokens of the
    prompt that re-render history the ledger held as ids (see :meth:`Ledger.prepare`), else 0.
    ``allow_tool_calls``: False when the request said ``tool_choice: none`` (the turn's text
    is not parsed for calls; the tools stay in the prompt). ``images``: the encoded bytes of
    every image in ``prompt_ids``, in token order (pass them to ``engine.generate(...,
    images=...)``); ``image_refs``: the placeholder runs ``tail_ids`` adds, positioned in the
    segment. ``cause``: on a rewrite, why the open segment could not be extended (one of
    :data:`REWRITE_CAUSES`), else None.
    """

    mode: Literal["start", "extend", "rewrite", "retry"]
    prompt_ids: list[int]
    tail_ids: list[int]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_text: str
    key: tuple[Any, ...]
    epoch: int
    cached: AssistantTurn | None = None
    reencoded: int = 0
    allow_tool_calls: bool = True
    images: list[bytes] = field(default_factory=list)
    image_refs: list[ImageRef] = field(default_factory=list)
    cause: str | None = None


@dataclass
class _Open:
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    spans: list[SampledSpan] = field(default_factory=list)
    routed: list[Any] | None = None
    routed_ok: bool = True
    finish_reason: str | None = None
    images: list[ImageRef] = field(default_factory=list)

    def segment(self) -> Segment:
        routed = self.routed if (self.routed_ok and self.routed is not None and len(self.routed) == len(self.token_ids)) else None
        # spans are copied with their record: a caller mutating a returned segment never edits the ledger's
        return Segment(token_ids=list(self.token_ids), loss_mask=list(self.loss_mask), logprobs=list(self.logprobs),
                       versions=list(self.versions), routed_experts=routed, spans=[sp.model_copy(deep=True) for sp in self.spans],
                       finish_reason=self.finish_reason, images=[im.model_copy() for im in self.images])


# --------------------------------------------------------------------------- ledger


#: (id(tokenizer), chat template, template kwargs) -> facts derived by Ledger._fast_render/_probe
_TEMPLATE_FACTS: dict[tuple[int, str, str], tuple[Any, ...]] = {}

#: per tokenizer: template text -> its ids (:meth:`Ledger._encode`), at most ``_ENCODED_MAX``
#: texts each, oldest dropped first
_ENCODED: weakref.WeakKeyDictionary[Any, dict[str, tuple[int, ...]]] = weakref.WeakKeyDictionary()
_ENCODED_MAX = 4096
_ENCODED_LOCK = threading.Lock()


class Ledger:
    """Token-exact accumulation of one session (one rollout); thread-safe.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (``apply_chat_template``,
            ``encode``, ``decode``).
        rollout_id: shared by every segment's trajectory (default: a fresh ``r-<hex>``).
        group_id: the group (prompt) this rollout belongs to.
        chat_template_kwargs: extra template variables, e.g. ``{"enable_thinking": False}``.
        think_tags / tool_call_tags: the model's reasoning and tool-call delimiters.
        tool_parser: a :mod:`molt_core.ledger.parsers` family name (``hermes``, ``qwen3_coder``,
            ``llama3_json``, ``mistral``, ``auto``: from the tokenizer) or a parser object;
            default: Hermes with ``tool_call_tags``.
        window_render: check an extension by rendering a window of the conversation when the
            chat template is proven window-local (:mod:`molt_core.ledger.render`; same verdict
            and tail as the full render, cost independent of the turn count); False always
            renders the whole conversation (the reference path, kept for benchmarks and tests).
        vision: the model's image processor from the modality plugin (``molt_register_modalities``:
            its ``expand`` / ``extra_tokens``); None for a text-only model (a message with an
            image is then refused).
        image_policy: limits for image parts (:class:`~molt_core.config.ImagePolicy`; default
            limits, no remote URLs).
        modality: the registered modality (its ``decode_part`` reads image parts); default
            ``vision``'s own ``decode_part``; None with no ``vision``: image parts are refused.

    Raises:
        ValueError: the tokenizer has no chat template, or an unknown ``tool_parser`` name.
    """

    def __init__(self, tokenizer: Any, rollout_id: str | None = None, group_id: str = "",
                 chat_template_kwargs: dict[str, Any] | None = None,
                 think_tags: tuple[str, str] = ("<think>", "</think>"),
                 tool_call_tags: tuple[str, str] = ("<tool_call>", "</tool_call>"),
                 tool_parser: str | ToolParser | None = None, window_render: bool = True, vision: Any = None,
                 image_policy: Any = None, modality: Any = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; the ledger renders conversations with it")
        self.tokenizer = tokenizer
        self.rollout_id = rollout_id or new_id("r")
        self.group_id = group_id
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.think = think_tags
        self.tool_parser: ToolParser = HermesParser(tool_call_tags) if tool_parser is None else get_tool_parser(tool_parser, tokenizer)
        self.counts = {"start": 0, "extend": 0, "rewrite": 0, "retry": 0}
        #: rewrites per cause (:data:`REWRITE_CAUSES`)
        self.rewrite_causes = dict.fromkeys(REWRITE_CAUSES, 0)
        # history index of each assistant message the ledger returned -> the reply the wire sent
        self._replies: dict[int, _Reply] = {}
        #: context tokens re-encoded from text on rewrites (see :meth:`prepare`)
        self.context_reencoded_tokens = 0
        #: committed generations that ended with finish reason ``length`` (cut by max_tokens)
        self.length_cut_turns = 0
        self._lock = threading.RLock()
        self._sealed: list[Segment] = []
        self._open = _Open()
        self._history: list[dict[str, Any]] = []
        self._tools: list[dict[str, Any]] | None = None
        self._last_prompt_text = ""
        self._last_turn: AssistantTurn | None = None
        self._epoch = 0
        self._last_req: tuple[Any, ...] | None = None
        self.vision = vision
        #: the rollout's images: SHA-256 -> encoded bytes, each distinct image once (an image of a
        #: request that later failed stays too; the trajectory stores only those its segments show)
        self._images: dict[str, bytes] = {}
        # normalize_messages, reusing the previous request's normalized prefix
        self._normalize = NormalizeCache(self._images, image_policy, getattr(modality or vision, "decode_part", None))
        #: extend checks decided by a window render / by the full render (see ``window_render``)
        self.render_stats = {"window": 0, "full": 0}
        # per window scan: indices of the committed history's messages that satisfy it, and
        # how many history messages were scanned (reset when a start/rewrite replaces history)
        self._scan_hits: list[list[int]] = []
        self._scan_n = 0
        # the template facts depend only on the tokenizer and template kwargs: derive them once
        key = (id(tokenizer), tokenizer.chat_template, json.dumps(self.template_kwargs, sort_keys=True, default=str))
        facts = _TEMPLATE_FACTS.get(key)
        if facts is None:
            self._fast_render()
            self._probe()
            compiled: Any = getattr(self, "_compiled", None)
            proof = prove_window(tokenizer.chat_template, compiled.environment)[0] if compiled is not None else None
            facts = (self._compiled, getattr(self, "_template_vars", {}), self.turn_close, self.body_prefix,
                     self.stop_token_ids, proof)
            _TEMPLATE_FACTS[key] = facts
        self._compiled, self._template_vars, self.turn_close, self.body_prefix, self.stop_token_ids, proof = facts
        #: the template's window proof (None: every extend check renders the whole conversation)
        self.window_proof: WindowProof | None = proof if window_render else None
        self._scan_hits = [[] for _ in (proof.scans if proof else [])]

    # ---------------------------------------------------------------- template facts

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages`` (with ``tools`` and the session's template kwargs).

        Same text as ``tokenizer.apply_chat_template(..., tokenize=False)`` (checked on a probe
        conversation at construction), rendered through the compiled template directly when
        possible: the messages here are already plain dicts, so the wrapper's conversions are
        skipped (about 3x faster on long conversations).

        Raises:
            ValueError: the template refused the messages (its ``raise_exception``).
        """
        from jinja2 import TemplateError

        try:
            if self._compiled is not None:
                return self._compiled.render(messages=[_chat_form(m) for m in messages], tools=tools or None, documents=None,
                                             add_generation_prompt=add_generation_prompt, **self._template_vars)
            return self.tokenizer.apply_chat_template(messages, tools=tools or None,
                                                      add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **self.template_kwargs)
        except TemplateError as e:  # e.g. the template's raise_exception("roles must alternate")
            raise ValueError(f"the chat template cannot render these messages: {e}") from None

    def _fast_render(self) -> None:
        self._compiled = None
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self.tokenizer.chat_template)
        except Exception:  # another transformers version or a template only the wrapper handles
            return
        self._template_vars = {**getattr(self.tokenizer, "special_tokens_map", {}), **self.template_kwargs}
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": _PROBE_USER},
                 {"role": "assistant", "content": _PROBE_ASSISTANT, "reasoning_content": "r",
                  "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
                 {"role": "tool", "content": "t"}, {"role": "user", "content": "u"}]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        slow = self.tokenizer.apply_chat_template(probe, tools=tools, add_generation_prompt=True, tokenize=False,
                                                  **self.template_kwargs)
        self._compiled = compiled
        try:
            same = self.render(probe, tools) == slow
        except Exception:
            same = False
        if not same:
            self._compiled = None

    def _probe(self) -> None:
        """Derive the assistant-turn header, close and generation-prompt body prefix by
        rendering a probe conversation (no hard-coded ChatML)."""
        u = [{"role": "user", "content": _PROBE_USER}]
        ua = u + [{"role": "assistant", "content": _PROBE_ASSISTANT}]
        r_u, r_ug, r_ua = self.render(u, add_generation_prompt=False), self.render(u), self.render(ua, add_generation_prompt=False)
        self.turn_close: str | None = None
        self.body_prefix = ""
        if r_ua.startswith(r_u) and _PROBE_ASSISTANT in r_ua[len(r_u):]:
            turn = r_ua[len(r_u):]
            i = turn.index(_PROBE_ASSISTANT)
            header, self.turn_close = turn[:i], turn[i + len(_PROBE_ASSISTANT):]
            gen = r_ug[len(r_u):] if r_ug.startswith(r_u) else ""
            if gen.startswith(header):
                self.body_prefix = gen[len(header):]
        tok = self.tokenizer
        stops = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        if self.turn_close:
            first = self._encode(self.turn_close)[:1]
            if first and first[0] in set(getattr(tok, "all_special_ids", [])):
                stops.add(first[0])
        #: token ids that end an assistant turn (pass them to the engine as ``stop_token_ids``)
        self.stop_token_ids = sorted(stops)

    def _encode(self, text: str) -> list[int]:
        """Tokenize template / new-message text (never generated text). Encoding is a pure
        function of (tokenizer, text): the ids of a recent text are reused (the
        ``n_samples_per_prompt`` rollouts of a group render the same prompt; issue 16 item 2)."""
        if not text:
            return []
        cache = _ENCODED.get(self.tokenizer)
        if cache is None:
            with _ENCODED_LOCK:
                cache = _ENCODED.setdefault(self.tokenizer, {})
        ids = cache.get(text)
        if ids is None:
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            with _ENCODED_LOCK:  # sessions of the loopback server run on several threads
                if len(cache) >= _ENCODED_MAX:
                    cache.pop(next(iter(cache)))  # the oldest entry (dicts keep insertion order)
                cache[text] = ids
        return list(ids)

    # ---------------------------------------------------------------- prepare / commit

    def prepare(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                params: SamplingParams | None = None, max_prompt_tokens: int | None = None,
                fresh: bool = False, allow_tool_calls: bool = True) -> Prepared:
        """Plan a request without changing the ledger (see the module doc for the modes).

        Args:
            messages: the request's chat messages (OpenAI form; normalized here).
            tools: OpenAI-form tool schemas (``[{"type": "function", "function": {...}}]``).
            params: sampling settings (part of the retry key only).
            max_prompt_tokens: refuse a prompt of this many tokens or more (the context
                length). Checked cheaply *before* tokenizing -- the text to encode is at least
                ``ceil(chars / max_token_bytes(tokenizer))`` tokens -- and exactly after.
            fresh: never answer from the cached turn (a new sample of an identical request; on
                the same messages that is a rewrite: a new segment).
            allow_tool_calls: False for ``tool_choice: none``: the turn is not parsed for
                calls (part of the retry key).

        On a rewrite, ``Prepared.reencoded`` is the token count, in the chat template's render
        (without generation prompt), of every request message that equals a committed history
        message (compared as the extend check does, matched in order wherever it sits: after a
        prepended system message or an edited earlier message too, assistant replies included)
        -- history the ledger held as ids and now re-encodes from text; the whole prompt when
        the template refuses to render a prefix.

        Returns:
            A :class:`Prepared`; send ``prepared.prompt_ids`` to the engine.

        Raises:
            ValueError: malformed messages (see :func:`normalize_messages`) or no messages.
            PromptTooLong: the prompt has ``max_prompt_tokens`` tokens or more (a ValueError).
        """
        msgs = self._normalize(messages)
        if not msgs:
            raise ValueError("messages is empty; send at least one message")
        tools = tools or None
        key = (msgs, tools, params.model_dump() if params else None, allow_tool_calls)
        with self._lock:
            epoch = self._epoch
            last = self._last_req
            if (self._last_turn is not None and key == last and not fresh and last is not None
                    and _same_messages(msgs, last[0]) and _same_json(tools, last[1])):
                return Prepared("retry", [], [], msgs, tools, self._last_prompt_text, key, epoch, cached=self._last_turn)
            ext = self._try_extend(msgs, tools, max_prompt_tokens)
            if not isinstance(ext, str):
                text, tail = ext
                o = self._open
                new = msgs[len(self._history):]
                tail, refs = expand_images(self.vision, tail, image_shas(new), self._images, len(o.token_ids))
                self._check_fits(len(o.token_ids) + len(tail), max_prompt_tokens)
                return Prepared("extend", o.token_ids + tail, tail, self._history + new, tools, text, key, epoch,
                                allow_tool_calls=allow_tool_calls, image_refs=refs,
                                images=[self._images[r.sha256] for r in o.images + refs])
            text = self.render(msgs, tools)
            self._check_fits_text(0, text, max_prompt_tokens)
            ids, refs = expand_images(self.vision, self._encode(text), image_shas(msgs), self._images, 0)
            self._check_fits(len(ids), max_prompt_tokens)
            images = [self._images[r.sha256] for r in refs]
            if not self._open.token_ids:
                return Prepared("start", ids, list(ids), msgs, tools, text, key, epoch, allow_tool_calls=allow_tool_calls,
                                images=images, image_refs=refs)
            return Prepared("rewrite", ids, list(ids), msgs, tools, text, key, epoch,
                            reencoded=self._reencoded(msgs, tools, len(ids)), allow_tool_calls=allow_tool_calls,
                            images=images, image_refs=refs, cause=ext)

    def _check_fits_text(self, held: int, text: str, limit: int | None) -> None:
        """Cheap pre-tokenization check: ``held`` ids + at least ``ceil(len(text) / max_token_bytes)``."""
        if limit is None:
            return
        low = held + -(-len(text) // max_token_bytes(self.tokenizer))
        if low >= limit:
            raise PromptTooLong(f"the prompt is at least {low} tokens ({len(text)} characters, at most "
                                f"{max_token_bytes(self.tokenizer)} per token); the model's context is {limit} tokens. "
                                "Shorten the conversation (or compact it)", low, limit, True)

    @staticmethod
    def _check_fits(n: int, limit: int | None) -> None:
        if limit is not None and n >= limit:
            raise PromptTooLong(f"the prompt is {n} tokens; the model's context is {limit} tokens. "
                                "Shorten the conversation (or compact it)", n, limit, False)

    def _reencoded(self, msgs: list[dict[str, Any]], tools: Any, prompt_len: int) -> int:
        """Tokens of a rewrite's prompt that re-render committed history (see :meth:`prepare`).

        Every request message equal to a committed history message (matched in order, as a
        subsequence: a prepended system message or an edited earlier message does not hide
        the held messages after it, model replies included) counts with its rendered tokens:
        ``len(encode(render(msgs[:i + 1]))) - len(encode(render(msgs[:i])))`` (no generation
        prompt), plus its images' expansion (each run's length - 1). The whole prompt counts
        when the template refuses to render a prefix."""
        hist = self._history
        matched: list[int] = []
        j = 0
        for i, m in enumerate(msgs):
            for jj in range(j, len(hist)):
                if self._echoes(jj, m):
                    matched.append(i)
                    j = jj + 1
                    break
        if not matched:
            return 0
        lens: dict[int, int] = {0: 0}

        def upto(k: int) -> int:
            if k not in lens:
                lens[k] = len(self._encode(self.render(msgs[:k], tools, add_generation_prompt=False)))
            return lens[k]

        try:
            return sum(max(0, upto(i + 1) - upto(i)) + extra_image_tokens(self.vision, image_shas(msgs[i:i + 1]), self._images)
                       for i in matched)
        except ValueError:  # the template refuses a prefix (e.g. must end on a user turn)
            return prompt_len

    def _echoes(self, i: int, m: dict[str, Any]) -> bool:
        """Request message ``m`` repeats committed history message ``i``: equal field for field
        (:func:`_same_messages`), or the reply the wire sent for that turn
        (:func:`_echoes_reply`)."""
        reply = self._replies.get(i)
        return _same_messages([self._history[i]], [m]) or (reply is not None and _echoes_reply(reply, m))

    def _try_extend(self, msgs: list[dict[str, Any]], tools: Any,
                    max_prompt_tokens: int | None = None) -> tuple[str, list[int]] | str:
        """``(new prompt text, tail ids)`` when ``msgs`` extends the committed history, else
        the cause (one of :data:`REWRITE_CAUSES`; the first request: ``history_edited``)."""
        hist = self._history
        k = len(hist)
        if self.turn_close is None:
            return "template_unprobed"
        if not k or len(msgs) < k:
            return "history_edited"
        if not _same_json(tools, self._tools):
            return "tools_changed"
        # fast path: the client echoed its previous request verbatim; then only the assistant
        # message we returned needs checking (as committed or as the wire sent it)
        prev = self._last_req[0] if self._last_req is not None else None
        fast = prev is not None and len(prev) == k - 1 and _same_messages(msgs[: k - 1], prev)
        for i in range(k - 1 if fast else 0, k):
            if not self._echoes(i, msgs[i]):
                return "reply_edited" if hist[i]["role"] == "assistant" else "history_edited"
        # render with the committed history (it holds what the model really produced, e.g. a
        # think block a client did not echo), then require the template to keep it verbatim
        win = self._window_check(hist, msgs[k:], tools) if self.window_proof is not None else None
        if win is not None:
            held_new, after = win
            held = self._last_prompt_text + held_new
            full = held + after
            self.render_stats["window"] += 1
        else:
            full = self.render(hist + msgs[k:], tools)
            held = self.render(hist, tools, add_generation_prompt=False)
            self.render_stats["full"] += 1
            if not (full.startswith(held) and held.startswith(self._last_prompt_text) and held.endswith(self.turn_close)):
                return "template_rewrites_history"
        close = self.turn_close
        o = self._open
        if o.finish_reason == "stop" and o.token_ids and o.loss_mask[-1] and self._last_stop_token:
            last = self.tokenizer.decode([o.token_ids[-1]], skip_special_tokens=False)
            if last and close.startswith(last):
                close = close[len(last):]
        tail = close + full[len(held):]
        self._check_fits_text(len(o.token_ids), tail, max_prompt_tokens)
        return full, self._encode(tail)

    def _window_check(self, hist: list[dict[str, Any]], new: list[dict[str, Any]],
                      tools: Any) -> tuple[str, str] | None:
        """The extend check through a window (:mod:`molt_core.ledger.render`).

        Renders ``W = hist[:head] + hist[j:]`` three ways -- without its last (assistant)
        message and with the generation prompt (the previous prompt), as is without it (the
        held history), with ``new`` and the generation prompt (the new prompt) -- and requires
        each to extend the one before, with the held history ending on the turn close. Returns
        ``(held[len(previous prompt):], new prompt[len(held):])``, equal to those of the full
        renders by the window proof, or None when no proven window applies or the window does
        not pass (the caller then renders the whole conversation, so the verdict is always the
        full render's)."""
        proof = self.window_proof
        assert proof is not None and self._compiled is not None and self.turn_close is not None
        head, close = hist[: proof.head], self.turn_close
        try:
            last_prev, last_full = self._scan_lasts(hist, new)
            j = window_start(proof, len(hist) - 1, last_prev, last_full)
            if j is None:
                return None
            prev = self._render_window(head + hist[j:-1], tools, True)
            held = self._render_window(head + hist[j:], tools, False)
            full = self._render_window(head + hist[j:] + new, tools, True)
        except Exception:  # noqa: BLE001 - NegativeIndex, a template error: the full render decides (and raises)
            return None
        if not (full.startswith(held) and held.startswith(prev) and len(held) - len(prev) >= len(close)
                and held.endswith(close)):
            return None
        return held[len(prev):], full[len(held):]

    def _render_window(self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool) -> str:
        """:meth:`render` of a window, its message list refusing negative subscripts
        (:class:`~molt_core.ledger.render.NegativeIndex`); template errors propagate as raised."""
        assert self._compiled is not None
        return self._compiled.render(messages=WindowMessages(_chat_form(m) for m in messages), tools=tools or None,
                                     documents=None, add_generation_prompt=add_generation_prompt, **self._template_vars)

    def _scan_lasts(self, hist: list[dict[str, Any]], new: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """Per window scan: the last index satisfying it in ``hist[:-1]`` and in ``hist + new``
        (-1: none). The committed history's hits are cached (scanned once per message)."""
        proof = self.window_proof
        assert proof is not None
        if self._scan_n > len(hist):  # pragma: no cover - the cache follows the history
            self._scan_hits, self._scan_n = [[] for _ in proof.scans], 0
        found: list[list[int]] = [[] for _ in proof.scans]
        for i in range(self._scan_n, len(hist)):
            m = _chat_form(hist[i])
            for hits, scan in zip(found, proof.scans):
                if scan.pred(m):
                    hits.append(i)
        for hits, more in zip(self._scan_hits, found):  # only once every predicate ran (one may raise)
            hits += more
        self._scan_n = len(hist)
        n_prev = len(hist) - 1
        last_prev, last_full = [], []
        for hits, scan in zip(self._scan_hits, proof.scans):
            lp = hits[-1] if hits and hits[-1] < n_prev else (hits[-2] if len(hits) > 1 else -1)
            lf = hits[-1] if hits else -1
            for i in range(len(new) - 1, -1, -1):
                if scan.pred(_chat_form(new[i])):
                    lf = len(hist) + i
                    break
            last_prev.append(lp)
            last_full.append(lf)
        return last_prev, last_full

    def commit(self, prepared: Prepared, output: GenerationOutput, params: SamplingParams | None = None) -> AssistantTurn:
        """Record one successful generation atomically and return it parsed.

        Appends ``prepared.tail_ids`` (``loss_mask`` False) and ``output.token_ids``
        (``loss_mask`` True, with ``output.logprobs`` / ``output.versions`` and a
        :class:`SampledSpan` carrying ``params``' temperature / top-k / top-p and the engine's
        record: ``output.sampled_digest`` with the ids, checked at trainer ingress). The mask
        comes from the engine's reported tokens only -- nothing scans for an EOS id (B06/B07).
        A ``retry`` plan records nothing and returns the cached turn. A failed request simply
        never calls ``commit``.

        Raises:
            LedgerConflict: another request was committed after ``prepared`` was made.
        """
        params = params or SamplingParams()
        with self._lock:
            if prepared.mode == "retry":
                self.counts["retry"] += 1
                assert prepared.cached is not None
                return prepared.cached
            if prepared.epoch != self._epoch:
                raise LedgerConflict("the session changed between prepare() and commit(); serialize its requests")
            # everything that can fail happens before the first mutation (atomic commit)
            turn = self.parse(prepared, output)
            replies = dict(self._replies) if prepared.mode == "extend" else {}
            replies[len(prepared.messages)] = (turn.content, turn.reasoning, _calls(turn.message()))
            sealed = self._open.segment() if prepared.mode == "rewrite" else None
            o = _Open() if sealed is not None else self._open
            n0 = len(o.token_ids)
            start = n0 + len(prepared.tail_ids)
            n = len(output.token_ids)
            lps, vs = [float(x) for x in output.logprobs], [int(v) for v in output.versions]
            # the engine's record travels with the span; ingress checks the segment against it
            span = SampledSpan(start=start, end=start + n, temperature=params.temperature, top_p=params.top_p,
                               top_k=params.top_k, digest=output.sampled_digest,
                               sampled_ids=list(output.token_ids) if output.sampled_digest is not None else None) if n else None
            if sealed is not None:
                self._sealed.append(sealed)
                self._open = o
            o.images += prepared.image_refs
            o.token_ids += prepared.tail_ids
            o.loss_mask += [False] * len(prepared.tail_ids)
            o.logprobs += [None] * len(prepared.tail_ids)
            o.versions += [None] * len(prepared.tail_ids)
            o.token_ids += output.token_ids
            o.loss_mask += [True] * n
            o.logprobs += lps
            o.versions += vs
            if span is not None:
                o.spans.append(span)
            o.finish_reason = output.finish_reason
            self._routed(o, n0, output)
            self._last_stop_token = output.finish_reason == "stop" and not isinstance(output.stop_reason, str)
            self._history = prepared.messages + [turn.message()]
            self._replies = replies
            if prepared.mode != "extend":  # the scan cache covers a history this one no longer extends
                self._scan_hits, self._scan_n = [[] for _ in self._scan_hits], 0
            self._tools = prepared.tools
            self._last_prompt_text = prepared.prompt_text
            self._last_req, self._last_turn = prepared.key, turn
            self.counts[prepared.mode] += 1
            if prepared.mode == "rewrite" and prepared.cause is not None:
                self.rewrite_causes[prepared.cause] += 1
            self.context_reencoded_tokens += prepared.reencoded
            self.length_cut_turns += output.finish_reason == "length"
            self._epoch += 1
            return turn

    _last_stop_token = False

    async def generate(self, engine: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, max_model_len: int | None = None) -> AssistantTurn:
        """One turn for a framework-owned loop: :meth:`prepare`, ``engine.generate``, :meth:`commit`.

        Adds :attr:`stop_token_ids` to ``params.stop_token_ids`` and caps ``max_tokens`` to
        ``max_model_len - prompt length``. An engine error propagates and records nothing.

        Raises:
            ValueError: malformed messages; :class:`PromptTooLong` for a prompt of
                ``max_model_len`` tokens or more.
        """
        params = params or SamplingParams()
        prepared = self.prepare(messages, tools, params, max_prompt_tokens=max_model_len)
        if prepared.mode == "retry":
            return self.commit(prepared, None)  # type: ignore[arg-type]
        n = len(prepared.prompt_ids)
        update: dict[str, Any] = {"stop_token_ids": sorted(set(params.stop_token_ids) | set(self.stop_token_ids))}
        if max_model_len is not None:
            update["max_tokens"] = min(params.max_tokens, max_model_len - n)
        run = params.model_copy(update=update)
        if prepared.images:
            out = await engine.generate(prepared.prompt_ids, run, images=prepared.images)
        else:  # a text-only engine need not accept ``images``
            out = await engine.generate(prepared.prompt_ids, run)
        return self.commit(prepared, out, run)

    @staticmethod
    def _routed(o: _Open, n0: int, output: GenerationOutput) -> None:
        # routed_experts covers prompt + sampled positions of this request; keep the rows we
        # already hold for the segment's earlier positions and add the new ones
        if output.routed_experts is None:
            if output.token_ids:
                o.routed_ok = False
            return
        if n0 == 0:
            o.routed = list(output.routed_experts)
        elif o.routed is not None:
            # rows the segment holds without a selection (-1: the previous turn's last sampled
            # token, which only this request's prefill ran) take this request's row
            new = output.routed_experts
            o.routed = [new[i] if i < len(new) and any(x < 0 for layer in row for x in layer) else row
                        for i, row in enumerate(o.routed)]
            o.routed += list(new[n0:])
        else:
            o.routed_ok = False

    # ---------------------------------------------------------------- parsing

    def parse(self, prepared: Prepared, output: GenerationOutput) -> AssistantTurn:
        """Turn a generation into an :class:`AssistantTurn` (decoding only; ids stay exact).

        Removes the stop token (``finish_reason == "stop"`` with a token stop reason, or an
        id in :attr:`stop_token_ids`) or cuts the text at the stop string, splits the think
        block (a generation prompt that opened ``<think>`` counts, B04) and extracts the
        tool calls after it with :attr:`tool_parser` (JSON-aware; none when
        ``prepared.allow_tool_calls`` is False).
        """
        ids = list(output.token_ids)
        stop_seq = output.stop_reason if isinstance(output.stop_reason, str) else None
        if output.finish_reason == "stop" and ids and stop_seq is None and (
                output.stop_reason == ids[-1] or ids[-1] in self.stop_token_ids):
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
        if stop_seq and stop_seq in text:
            text = text[: text.index(stop_seq)]
        prefix = self.body_prefix if prepared.prompt_text.endswith(self.body_prefix) else ""
        body = prefix + text
        calls, spans = [], []
        open_t, close_t = self.think
        visible_from = body.rfind(close_t) + len(close_t) if close_t in body else (len(body) if open_t in body else 0)
        found = self.tool_parser.parse(body, visible_from, prepared.tools) if prepared.allow_tool_calls else []
        for k, c in enumerate(found):
            calls.append({"id": _call_id(prepared.prompt_ids, ids, k), "name": c.name, "arguments": c.arguments})
            if not spans or spans[-1] != c.span:
                spans.append(c.span)
        raw = body
        for a, b in reversed(spans):
            raw = raw[:a] + raw[b:]
        raw = raw.rstrip() if spans else raw
        reasoning = None
        if close_t in raw:
            head, _, vis = raw.rpartition(close_t)
            reasoning = head.split(open_t)[-1].strip("\n")
        elif open_t in raw:
            reasoning, vis = raw.split(open_t, 1)[1].strip("\n"), ""
        else:
            vis = raw
        finish = output.finish_reason
        if calls and finish == "stop":
            finish = "tool_calls"
        return AssistantTurn(content=vis.strip(), reasoning=reasoning or None, tool_calls=calls, raw=raw,
                             finish_reason=finish, stop_sequence=stop_seq, token_ids=list(output.token_ids),
                             logprobs=list(output.logprobs), prompt_len=len(prepared.prompt_ids))

    # ---------------------------------------------------------------- read out

    def segments(self) -> list[Segment]:
        """The sealed segments and the open one (if it holds tokens), validated."""
        with self._lock:
            out = list(self._sealed)
            if self._open.token_ids:
                out.append(self._open.segment())
            return out

    @property
    def history(self) -> list[dict[str, Any]]:
        """The committed conversation (last request's messages + the assistant message returned).

        Messages with images hold them as ``{"type": "image", "sha256": hex}`` parts (the bytes
        stay in the rollout's store); sending this history back (as the Env loop does) extends it."""
        with self._lock:
            return [dict(m) for m in self._history]

    @property
    def num_tokens(self) -> int:
        """Tokens held in the open segment."""
        return len(self._open.token_ids)

    def trajectory(self, reward: float | None = None, score: float | None = None, info: dict[str, Any] | None = None,
                   status: Literal["ok", "failed"] = "ok", error: str | None = None, task: dict[str, Any] | None = None,
                   truncated: bool = False) -> Trajectory:
        """The session's :class:`Trajectory`: every segment, one ``rollout_id`` and ``reward``.

        ``info`` is the caller's (the agent's) merged under the ledger-owned keys
        (:data:`LEDGER_INFO_KEYS`, which win): ``requests`` (count per mode),
        ``context_reencoded_tokens`` (see :meth:`prepare`), ``length_cut_turns`` and
        ``rewrite_causes`` (rewrites per :data:`REWRITE_CAUSES` entry, each listed).
        ``truncated`` is True when the caller says so or when any committed generation of
        the session ended with finish reason ``length`` (cut by ``max_tokens``). ``images``
        holds (base64) each distinct image the segments show, once.
        """
        with self._lock:
            inf = {**(info or {}), **self.owned_info()}
            segs = self.segments()
            shown = {im.sha256 for s in segs for im in s.images}
            images = {h: base64.b64encode(self._images[h]).decode("ascii") for h in sorted(shown)}
            return Trajectory(rollout_id=self.rollout_id, group_id=self.group_id, segments=segs, reward=reward,
                              score=score, info=inf, status=status, error=error, task=task or {},
                              truncated=bool(truncated or self.length_cut_turns), images=images)

    def owned_info(self) -> dict[str, Any]:
        """The ledger-owned ``info`` entries (:data:`LEDGER_INFO_KEYS`) of the session so far."""
        with self._lock:
            return {"requests": dict(self.counts), "context_reencoded_tokens": self.context_reencoded_tokens,
                    "length_cut_turns": self.length_cut_turns, "rewrite_causes": dict(self.rewrite_causes)}
