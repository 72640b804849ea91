"""Image inputs: decode, validate and hash one image part; the internal content part.

Every wire (OpenAI ``image_url``, Anthropic ``image`` blocks, Responses ``input_image``) and
every framework-owned Env hands the ledger an image as one **internal content part**, the
OpenAI Chat shape with a base64 data URL::

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo..."}}

:func:`image_part` builds it from encoded bytes (what an Env uses); the wires convert their own
shapes to it (:mod:`molt_plugins.vision.wire`). The ledger (:mod:`molt_core.ledger.messages`)
reads it back with :func:`decode_part`, keeps the bytes once per rollout keyed by their
SHA-256 and renders the message through the chat template with ``{"type": "image", "sha256":
...}`` in its place (:data:`IMAGE_PART_TYPE`).

An image is accepted when (:class:`ImagePolicy`, defaults in brackets):

* its media type is one of :data:`MEDIA_TYPES` (png, jpeg, gif, webp), as declared and as
  Pillow identifies the bytes -- a JPEG sent as ``image/png`` is refused;
* it is at most ``max_bytes`` encoded bytes [20 MiB] and ``max_pixels`` pixels [33,177,600:
  the pixel count is read from the header, before any pixel is decoded];
* Pillow decodes it completely (a truncated or corrupt file is refused);
* a remote ``http(s)://`` URL only when ``allow_remote_urls`` [False]: then it is fetched
  (:func:`fetch_url`) with ``fetch_timeout_s`` [10 s] and the same byte cap, and validated
  like inline bytes. Other URL schemes are always refused.

Failures raise :class:`ImageError` (a ``ValueError``) whose message names the field path given
by the caller (``messages[0].content[1].image_url.url``); each wire turns it into a 400 in its
own error shape.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from molt_core.config import ImagePolicy
from molt_core.ledger.messages import IMAGE_PART_TYPE

__all__ = ["MEDIA_TYPES", "IMAGE_PART_TYPE", "ImagePolicy", "ImageError", "DecodedImage", "image_part",
           "data_url", "decode_bytes", "decode_base64", "decode_url", "decode_part", "fetch_url", "is_image_part"]

#: accepted media type -> the Pillow format name its bytes must have
MEDIA_TYPES: dict[str, str] = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP"}
_FORMAT_MEDIA = {v: k for k, v in MEDIA_TYPES.items()}


_DEFAULT = ImagePolicy()


class ImageError(ValueError):
    """A refused image: ``field`` is the path of the offending field in the request
    (``messages[0].content[1].image_url.url``), ``message`` says what is wrong and the fix."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class DecodedImage:
    """A validated image: ``data`` (the encoded bytes as received), ``media_type``
    (``image/png`` ...), ``sha256`` (hex digest of ``data``), ``width`` / ``height`` in pixels."""

    data: bytes
    media_type: str
    sha256: str
    width: int
    height: int

    def part(self) -> dict[str, Any]:
        """The internal content part for this image (a base64 data URL, see the module doc)."""
        return {"type": "image_url", "image_url": {"url": data_url(self.data, self.media_type)}}


# sha256 -> (media type, width, height) of bytes Pillow already decoded: a client re-sends every
# earlier image each turn; only the first sight pays for the decode (bounded LRU)
_SEEN: OrderedDict[str, tuple[str, int, int]] = OrderedDict()
_SEEN_MAX = 4096
_SEEN_LOCK = threading.Lock()


def data_url(data: bytes, media_type: str) -> str:
    """``data:<media_type>;base64,<data as base64>``."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"


def image_part(data: bytes, media_type: str = "image/png", policy: ImagePolicy | None = None) -> dict[str, Any]:
    """The internal content part for encoded image ``data`` (what an Env puts in a message's
    ``content`` list next to ``{"type": "text", "text": ...}`` parts).

    Args:
        data: the encoded file (PNG, JPEG, GIF or WebP bytes), e.g. ``buf.getvalue()`` after
            ``PIL.Image.save(buf, "PNG")``.
        media_type: its media type (one of :data:`MEDIA_TYPES`).
        policy: limits to check against (default :class:`ImagePolicy()`).

    Raises:
        ImageError: (field ``image``) the bytes are not a decodable image of ``media_type``
            within the limits.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"expected the encoded image bytes, got {type(data).__name__}", "image")
    return decode_bytes(bytes(data), media_type, "image", policy).part()


def decode_bytes(data: bytes, media_type: str | None, where: str, policy: ImagePolicy | None = None) -> DecodedImage:
    """Validate encoded image bytes (module doc) and hash them.

    Args:
        data: the encoded bytes.
        media_type: the declared media type; None accepts whatever supported format the bytes are.
        where: the field path named in errors.
        policy: the limits (default :class:`ImagePolicy()`).

    Raises:
        ImageError: unsupported or mismatched media type, over ``max_bytes`` / ``max_pixels``,
            or not decodable.
    """
    policy = policy or _DEFAULT
    if media_type is not None and media_type not in MEDIA_TYPES:
        raise ImageError(f"media type {media_type!r} is not supported; send one of {', '.join(MEDIA_TYPES)}", where)
    if len(data) > policy.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes, over the limit of {policy.max_bytes} bytes; send a smaller "
                         "image (or raise images.max_bytes)", where)
    if not data:
        raise ImageError("the image is empty (0 bytes)", where)
    digest = hashlib.sha256(data).hexdigest()
    with _SEEN_LOCK:
        seen = _SEEN.get(digest)
        if seen is not None:
            _SEEN.move_to_end(digest)
    if seen is None:
        seen = _pillow_check(data, where, policy)
        with _SEEN_LOCK:
            _SEEN[digest] = seen
            while len(_SEEN) > _SEEN_MAX:
                _SEEN.popitem(last=False)
    actual, w, h = seen
    if media_type is not None and actual != media_type:
        raise ImageError(f"the bytes are an {actual} image but the media type says {media_type}; send the image's "
                         "real media type", where)
    if w * h > policy.max_pixels:
        raise ImageError(f"the image is {w}x{h} = {w * h} pixels, over the limit of {policy.max_pixels}; send a "
                         "smaller image (or raise images.max_pixels)", where)
    return DecodedImage(data, actual, digest, w, h)


def _pillow_check(data: bytes, where: str, policy: ImagePolicy) -> tuple[str, int, int]:
    """(media type, width, height) of bytes Pillow decodes completely; the pixel count is
    checked from the header before decoding (a decompression bomb never allocates)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt, (w, h) = im.format, im.size
            if fmt not in _FORMAT_MEDIA:
                raise ImageError(f"the bytes are an {fmt} image; send one of {', '.join(MEDIA_TYPES)}", where)
            if w * h > policy.max_pixels:
                raise ImageError(f"the image is {w}x{h} = {w * h} pixels, over the limit of {policy.max_pixels}; "
                                 "send a smaller image (or raise images.max_pixels)", where)
            im.load()
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError("the bytes are not an image Pillow can read (png, jpeg, gif or webp expected)", where) from None
    except Exception as e:  # noqa: BLE001 - truncated / corrupt data: Pillow raises OSError, SyntaxError, ValueError...
        raise ImageError(f"the image cannot be decoded ({type(e).__name__}: {e}); send a complete, valid file",
                         where) from None
    return _FORMAT_MEDIA[fmt], w, h


def decode_base64(b64: Any, media_type: Any, where: str, policy: ImagePolicy | None = None,
                  media_where: str | None = None) -> DecodedImage:
    """An image given as base64 text plus its media type (Anthropic's ``source`` of type
    ``base64``; ``where`` names the ``data`` field, ``media_where`` the media type's field,
    default ``where``'s sibling ``media_type``).

    Raises:
        ImageError: not a string, not base64, or refused by :func:`decode_bytes`.
    """
    policy = policy or _DEFAULT
    if not isinstance(media_type, str) or media_type not in MEDIA_TYPES:
        field = media_where or (where.rsplit(".", 1)[0] + ".media_type" if "." in where else "media_type")
        raise ImageError(f"media type {media_type!r} is not supported; send one of {', '.join(MEDIA_TYPES)}", field)
    if not isinstance(b64, str):
        raise ImageError(f"expected base64 text, got {type(b64).__name__}", where)
    if len(b64) > 4 * (policy.max_bytes // 3 + 1) + 4:  # refuse before decoding
        raise ImageError(f"the image is over the limit of {policy.max_bytes} bytes (base64 of {len(b64)} characters); "
                         "send a smaller image (or raise images.max_bytes)", where)
    try:
        data = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data is not valid base64", where) from None
    return decode_bytes(data, media_type, where, policy)


def decode_url(url: Any, where: str, policy: ImagePolicy | None = None) -> DecodedImage:
    """An image given as a URL: a ``data:<media type>;base64,...`` URL, or -- only when
    ``policy.allow_remote_urls`` -- an ``http(s)://`` URL, fetched (blocking; call it from a
    worker thread on a server).

    Raises:
        ImageError: a remote URL that is not allowed, another scheme, a malformed data URL,
            a failed fetch, or refused by :func:`decode_bytes`.
    """
    policy = policy or _DEFAULT
    if not isinstance(url, str):
        raise ImageError(f"expected a URL string, got {type(url).__name__}", where)
    if url.startswith("data:"):
        head, sep, b64 = url.partition(",")
        params = head[5:].split(";")
        if not sep or "base64" not in params[1:]:
            raise ImageError("a data URL must be base64: data:<media type>;base64,<data>", where)
        return decode_base64(b64, params[0].lower() or None, where, policy, media_where=where)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        if not policy.allow_remote_urls:
            raise ImageError("remote image URLs are refused (the rollout must not depend on the network); send the "
                             "image inline as a data URL (data:image/png;base64,...), or allow them in the recipe: "
                             "[images] allow_remote_urls = true", where)
        data, media_type = fetch_url(url, where, policy)
        return decode_bytes(data, media_type, where, policy)
    raise ImageError(f"unsupported URL scheme {scheme!r}; send a data URL (data:image/png;base64,...)", where)


def fetch_url(url: str, where: str, policy: ImagePolicy | None = None) -> tuple[bytes, str | None]:
    """GET ``url`` with ``policy.fetch_timeout_s`` and a ``policy.max_bytes`` cap (the
    download stops as soon as it goes over). Returns ``(bytes, media type or None)`` (the
    ``Content-Type`` when it is a supported image type, else None: the bytes decide).

    Raises:
        ImageError: an HTTP error status, a timeout, a connection error, or too many bytes.
    """
    import httpx

    policy = policy or _DEFAULT
    try:
        with httpx.stream("GET", url, timeout=policy.fetch_timeout_s, follow_redirects=True) as r:
            if r.status_code != 200:
                raise ImageError(f"fetching the image returned HTTP {r.status_code}", where)
            chunks, n = [], 0
            for chunk in r.iter_bytes():
                n += len(chunk)
                if n > policy.max_bytes:
                    raise ImageError(f"the image is over the limit of {policy.max_bytes} bytes; send a smaller image "
                                     "(or raise images.max_bytes)", where)
                chunks.append(chunk)
            ctype = r.headers.get("content-type", "").split(";")[0].strip().lower()
    except ImageError:
        raise
    except httpx.TimeoutException:
        raise ImageError(f"fetching the image timed out after {policy.fetch_timeout_s} s", where) from None
    except httpx.HTTPError as e:
        raise ImageError(f"fetching the image failed ({type(e).__name__}: {e})", where) from None
    return b"".join(chunks), (ctype if ctype in MEDIA_TYPES else None)


def is_image_part(part: Any) -> bool:
    """True for an internal image part (``{"type": "image_url", ...}``)."""
    return isinstance(part, dict) and part.get("type") == "image_url"


def decode_part(part: Any, where: str, policy: ImagePolicy | None = None) -> DecodedImage:
    """Read an internal image part (``where`` names the part, e.g. ``messages[0].content[1]``).

    Raises:
        ImageError: a malformed part (naming ``<where>.image_url.url``) or a refused image.
    """
    iu = part.get("image_url") if isinstance(part, dict) else None
    url = iu.get("url") if isinstance(iu, dict) else iu if isinstance(iu, str) else None
    if url is None:
        raise ImageError("an image part is {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}",
                         f"{where}.image_url.url")
    return decode_url(url, f"{where}.image_url.url", policy)
