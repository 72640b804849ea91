"""Chat messages as the ledger reads them: validation and canonical form
(:func:`normalize_messages`), and :class:`NormalizeCache`, which reuses the previous request's
work for the unchanged prefix a client re-sends each turn."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

__all__ = ["normalize_messages", "NormalizeCache", "image_shas", "IMAGE_PART_TYPE", "Decode"]

#: the ``type`` of the part the ledger renders in an image's place (``{"type": "image", "sha256": hex}``)
IMAGE_PART_TYPE = "image"
#: a modality's image-part reader: ``decode(part, where, policy)`` -> ``.sha256`` (hex), ``.data``
#: (bytes); raises ValueError naming ``where``
Decode = Callable[[dict[str, Any], str, Any], Any]

_ROLES = ("system", "developer", "user", "assistant", "tool")
_IMAGE_ROLES = ("user", "tool")


def _content(content: Any, where: str, role: str, images: dict[str, bytes] | None,
             policy: Any, decode: Decode | None) -> str | list[dict[str, Any]]:
    """A message's canonical content: its text, or (with images) text and image parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out: list[Any] = []  # str for text runs, dict for image parts
        for j, part in enumerate(content):
            if isinstance(part, str):
                text = part
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                text = part["text"]
            elif isinstance(part, dict) and part.get("type") == "image_url":
                if role not in _IMAGE_ROLES:
                    raise ValueError(f"{where}.content[{j}]: images are accepted in user and tool messages only, "
                                     f"not in a {role} message")
                if decode is None:
                    raise ValueError(f"{where}.content[{j}]: an image part, but there is no vision processor: no "
                                     "modality plugin is loaded (enable molt_plugins.vision, see docs/vision.md) "
                                     "or send text only")
                img = decode(part, f"{where}.content[{j}]", policy)
                if images is not None:
                    images.setdefault(img.sha256, img.data)
                out.append({"type": IMAGE_PART_TYPE, "sha256": img.sha256})
                continue
            elif isinstance(part, dict) and part.get("type") == IMAGE_PART_TYPE and role in _IMAGE_ROLES:
                # the ledger's own canonical part (an Env loop re-sends its history)
                h = part.get("sha256")
                if not isinstance(h, str) or images is None or h not in images:
                    raise ValueError(f"{where}.content[{j}]: an image part {{'type': 'image', 'sha256': ...}} must name "
                                     "an image this rollout already holds; send new images as image_url parts")
                out.append({"type": IMAGE_PART_TYPE, "sha256": h})
                continue
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}.content[{j}]: only text and image parts are supported, got {kind!r}")
            if out and isinstance(out[-1], str):
                out[-1] += text
            else:
                out.append(text)
        if all(isinstance(p, str) for p in out):
            return "".join(out)
        return [{"type": "text", "text": p} if isinstance(p, str) else p for p in out if p != ""]
    raise ValueError(f"{where}.content must be a string or a list of text and image parts, got {type(content).__name__}")


def image_shas(messages: list[dict[str, Any]]) -> list[str]:
    """The SHA-256 of every image in canonical ``messages``, in render order."""
    return [p["sha256"] for m in messages if isinstance(m["content"], list)
            for p in m["content"] if p.get("type") == IMAGE_PART_TYPE]


def _arguments(args: Any, where: str) -> dict[str, Any]:
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.arguments is not valid JSON ({e.msg}); send the JSON object the model produced") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}.arguments must be a JSON object, got {type(args).__name__}")
    return args


def normalize_messages(messages: Any, images: dict[str, bytes] | None = None,
                       policy: Any = None, decode: Decode | None = None) -> list[dict[str, Any]]:
    """Canonical OpenAI-style chat messages for rendering and comparison.

    Each becomes ``{"role", "content"}`` plus, where present, ``tool_calls`` (``[{"id", "type":
    "function", "function": {"name", "arguments": dict}}]``), ``tool_call_id``, ``name``,
    ``reasoning_content``. All-text content becomes a string; a user or tool message with image
    parts keeps ``{"type": "text", "text"}`` and ``{"type": "image", "sha256"}`` parts, ``decode``
    (the modality's :data:`Decode`; None refuses images) reading each under ``policy`` into ``images``.

    Raises:
        ValueError: naming ``messages[i].<field>``: not a list of objects, unknown role, a part
            neither text nor image, an image outside a user or tool message, a nameless tool call,
            arguments not a JSON object; or the modality's error for a refused image.
    """
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of message objects, got {type(messages).__name__}")
    return [_normalize_one(m, i, images, policy, decode) for i, m in enumerate(messages)]


def _normalize_one(m: Any, i: int, images: dict[str, bytes] | None = None,
                   policy: Any = None, decode: Decode | None = None) -> dict[str, Any]:
    """``messages[i]`` normalized (see :func:`normalize_messages`)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ValueError(f"{where} must be an object with 'role' and 'content', got {type(m).__name__}")
    role = m.get("role")
    if role not in _ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}")
    msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": _content(m.get("content"), where, role, images, policy, decode)}
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list and only on assistant messages")
        norm = []
        for j, c in enumerate(calls):
            w = f"{where}.tool_calls[{j}]"
            fn = c.get("function", c) if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"{w}.function.name must be a non-empty string")
            norm.append({"id": str(c.get("id") or ""), "type": "function",
                         "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments", {}), f"{w}.function")}})
        msg["tool_calls"] = norm
    for key in ("tool_call_id", "name", "reasoning_content"):
        if isinstance(m.get(key), str):
            msg[key] = m[key]
    return msg


class _Unfrozen(Exception):
    pass


_UNCACHED = object()  # compares unequal to every message: the prefix match stops there


#: data URLs (images) at least this long are held by the cache as a digest, not a copy
_DIGEST_MIN = 4096


class _Digest:
    """A long data URL in a frozen message: equal to a string of the same length and SHA-256."""

    __slots__ = ("n", "digest")

    def __init__(self, s: str) -> None:
        self.n, self.digest = len(s), hashlib.sha256(s.encode("utf-8", "surrogatepass")).digest()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Digest):
            return self.n == other.n and self.digest == other.digest
        return (type(other) is str and len(other) == self.n
                and hashlib.sha256(other.encode("utf-8", "surrogatepass")).digest() == self.digest)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = None  # type: ignore[assignment]


def _freeze(x: Any) -> Any:
    if x is None:
        return x
    if type(x) is str:
        return _Digest(x) if len(x) >= _DIGEST_MIN and x.startswith("data:") else x
    if type(x) is list:
        return [_freeze(v) for v in x]
    if type(x) is dict and all(type(k) is str for k in x):
        return {k: _freeze(v) for k, v in x.items()}
    raise _Unfrozen


def _frozen(m: Any) -> Any:
    """A private deep copy of raw ``m`` equal to a later message only if that one normalizes
    identically (only None, str, list, str-keyed dict; no object arguments), else :data:`_UNCACHED`."""
    try:
        fz = _freeze(m)
    except _Unfrozen:
        return _UNCACHED
    for c in (fz.get("tool_calls") or []) if isinstance(fz, dict) and isinstance(fz.get("tool_calls"), list) else []:
        fn = c.get("function", c) if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), dict):
            return _UNCACHED
    return fz


class NormalizeCache:
    """:func:`normalize_messages` with the previous call's longest equal prefix reused.

    The result and errors are exactly ``normalize_messages(messages)``'s; thread-safe (a race only
    loses the reuse). ``images`` / ``policy`` / ``decode``: as :func:`normalize_messages`.
    """

    def __init__(self, images: dict[str, bytes] | None = None, policy: Any = None, decode: Decode | None = None) -> None:
        self._state: tuple[list[Any], list[dict[str, Any]]] = ([], [])
        self.images, self.policy, self.decode = images, policy, decode

    def __call__(self, messages: Any) -> list[dict[str, Any]]:
        """Normalize ``messages``; raises ValueError like :func:`normalize_messages`."""
        if not isinstance(messages, list):
            return normalize_messages(messages, self.images, self.policy, self.decode)
        raw, norm = self._state
        n = min(len(raw), len(messages))
        p = n if messages[:n] == raw[:n] else 0
        while p < n and messages[p] == raw[p]:
            p += 1
        out = norm[:p] + [_normalize_one(messages[i], i, self.images, self.policy, self.decode)
                     for i in range(p, len(messages))]
        self._state = (raw[:p] + [_frozen(m) for m in messages[p:]], list(out))
        return out
