"""molt_plugins.vision.images: decode, validate and hash image parts (every refusal names its field)."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import threading

import pytest
from PIL import Image

from molt_plugins.vision.images import (
    ImageError,
    ImagePolicy,
    data_url,
    decode_base64,
    decode_bytes,
    decode_part,
    decode_url,
    image_part,
)


def png(w: int = 4, h: int = 3, color: tuple[int, int, int] = (255, 0, 0), fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, fmt)
    return buf.getvalue()


def test_image_part_round_trips_bytes_and_hash():
    data = png()
    part = image_part(data)
    assert part["type"] == "image_url"
    assert part["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(data).decode()
    img = decode_part(part, "messages[0].content[1]")
    assert img.data == data and img.media_type == "image/png" and (img.width, img.height) == (4, 3)
    assert img.sha256 == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("fmt,mt", [("JPEG", "image/jpeg"), ("GIF", "image/gif"), ("WEBP", "image/webp")])
def test_every_supported_format(fmt, mt):
    data = png(fmt=fmt)
    assert decode_url(data_url(data, mt), "x").media_type == mt


def test_media_type_must_match_the_bytes():
    with pytest.raises(ImageError) as e:
        decode_url(data_url(png(fmt="JPEG"), "image/png"), "messages[0].content[1].image_url.url")
    assert e.value.field == "messages[0].content[1].image_url.url"
    assert "image/jpeg" in str(e.value) and "image/png" in str(e.value)


def test_unsupported_media_type_names_the_field():
    with pytest.raises(ImageError) as e:
        decode_base64(base64.b64encode(png()).decode(), "image/bmp", "messages[0].content[0].source.data")
    assert e.value.field == "messages[0].content[0].source.media_type"
    with pytest.raises(ImageError, match="not supported"):
        decode_url("data:image/tiff;base64,AAAA", "u")


def test_undecodable_and_truncated_are_refused():
    with pytest.raises(ImageError, match="not an image"):
        decode_bytes(b"definitely not an image", "image/png", "f")
    data = png(64, 64, (1, 2, 3))
    with pytest.raises(ImageError, match="cannot be decoded"):
        decode_bytes(data[: len(data) // 2], "image/png", "f")
    with pytest.raises(ImageError, match="not valid base64"):
        decode_url("data:image/png;base64,%%%", "f")
    with pytest.raises(ImageError, match="must be base64"):
        decode_url("data:image/png,rawbytes", "f")
    with pytest.raises(ImageError, match="empty"):
        decode_bytes(b"", None, "f")


def test_size_limits_bytes_and_pixels():
    data = png(10, 10)
    with pytest.raises(ImageError, match=f"{len(data)} bytes, over the limit of {len(data) - 1}"):
        decode_bytes(data, "image/png", "f", ImagePolicy(max_bytes=len(data) - 1))
    decode_bytes(data, "image/png", "f", ImagePolicy(max_bytes=len(data)))
    with pytest.raises(ImageError, match="10x10 = 100 pixels, over the limit of 99"):
        decode_bytes(data, "image/png", "f", ImagePolicy(max_pixels=99))
    # the pixel limit holds on a cache hit too (the bytes were decoded above under the default policy)
    with pytest.raises(ImageError, match="over the limit of 99"):
        decode_bytes(data, "image/png", "f", ImagePolicy(max_pixels=99))
    # base64 over the byte limit is refused before decoding
    with pytest.raises(ImageError, match="over the limit of 3 bytes"):
        decode_base64("A" * 400, "image/png", "f", ImagePolicy(max_bytes=3))


def test_remote_urls_refused_by_default_and_other_schemes_always():
    with pytest.raises(ImageError, match="allow_remote_urls") as e:
        decode_url("https://example.com/cat.png", "messages[0].content[0].image_url.url")
    assert e.value.field == "messages[0].content[0].image_url.url"
    with pytest.raises(ImageError, match="unsupported URL scheme 'file'"):
        decode_url("file:///etc/passwd", "f", ImagePolicy(allow_remote_urls=True))


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, str, bytes]] = {}

    def do_GET(self):  # noqa: N802 - http.server API
        status, ctype, body = self.routes.get(self.path, (404, "text/plain", b"nope"))
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture()
def local_http():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", _Handler.routes
    srv.shutdown()
    srv.server_close()


def test_remote_fetch_when_allowed(local_http):
    base, routes = local_http
    data = png(5, 5)
    routes.update({"/a.png": (200, "image/png", data), "/big.png": (200, "image/png", png(200, 200, (9, 9, 9)) * 4),
                   "/html": (200, "text/html", b"<html></html>"), "/jpeg-as-png": (200, "image/png", png(fmt="JPEG"))})
    allow = ImagePolicy(allow_remote_urls=True, max_bytes=2000)
    img = decode_url(base + "/a.png", "f", allow)
    assert img.data == data and img.sha256 == hashlib.sha256(data).hexdigest()
    with pytest.raises(ImageError, match="HTTP 404"):
        decode_url(base + "/missing", "f", allow)
    with pytest.raises(ImageError, match="over the limit of 2000 bytes"):
        decode_url(base + "/big.png", "f", allow)
    with pytest.raises(ImageError, match="not an image"):
        decode_url(base + "/html", "f", allow)
    with pytest.raises(ImageError, match="image/jpeg image but the media type says image/png"):
        decode_url(base + "/jpeg-as-png", "f", allow)
    with pytest.raises(ImageError, match="allow_remote_urls"):
        decode_url(base + "/a.png", "f")


def test_fetch_timeout(local_http):
    base, routes = local_http
    done = threading.Event()

    class Slow(_Handler):
        def do_GET(self):  # noqa: N802
            done.wait(5)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ImageError, match="timed out after 0.3 s"):
            decode_url(f"http://127.0.0.1:{srv.server_address[1]}/x", "f",
                       ImagePolicy(allow_remote_urls=True, fetch_timeout_s=0.3))
    finally:
        done.set()
        srv.shutdown()
        srv.server_close()


def test_malformed_part_names_the_url_field():
    with pytest.raises(ImageError) as e:
        decode_part({"type": "image_url", "image_url": {}}, "messages[2].content[0]")
    assert e.value.field == "messages[2].content[0].image_url.url"
    with pytest.raises(ImageError, match="encoded image bytes"):
        image_part("not bytes")  # type: ignore[arg-type]
