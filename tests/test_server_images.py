"""Images through the loopback server with the real openai and anthropic SDKs: exact ids for
image turns on every wire (OpenAI Chat ``image_url``, Anthropic ``image`` blocks, Responses
``input_image``), with streaming and tool calls in the same conversations; bad images refused
per wire with a 400 in the wire's shape naming the field; remote URLs refused unless allowed.

Run lengths are computed by hand (see tests/test_ledger_images.py): an image of ``w x h``
pixels (multiples of 14 within 14*14..56*56) becomes ``(h / 14) * (w / 14)`` image tokens.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import threading

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from fake_engine import ScriptedEngine
from molt_core.identity import TokenCheck, check_tokens
from molt_plugins.vision.images import ImagePolicy, data_url
from molt_core.server import create_app, start_server

PAD = 514
TOOLS = [{"type": "function", "function": {"name": "zoom", "description": "zoom in",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]
A_TOOLS = [{"name": "zoom", "description": "zoom in",
            "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}]
CALL = '<tool_call>\n{"name": "zoom", "arguments": {"x": 1}}\n</tool_call>'


@pytest.fixture()
def served(vl):
    tok, vp = vl
    handles = []

    def make(engine, **kw):
        h = start_server(engine, tok, vision=vp, **kw)
        handles.append(h)
        return h

    yield make
    for h in handles:
        h.stop()


def png(w: int, h: int, color=(200, 30, 30), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, fmt)
    return buf.getvalue()


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def xp(ids, runs):
    """``ids`` with the k-th <|image_pad|> repeated runs[k] times (by hand)."""
    out, k = [], 0
    for t in ids:
        out += [t] * (runs[k] if t == PAD else 1)
        k += t == PAD
    assert k == len(runs)
    return out


def render(tok, msgs, tools=None, gen=True):
    return tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False)


def delta(tok, before, after, tools=None):
    """Template ids between a committed conversation ``before`` (its last assistant turn's
    sampled ids ended with <|im_end|>) and the next request ``after``."""
    held, full = render(tok, before, tools, gen=False), render(tok, after, tools)
    assert full.startswith(held)
    return enc(tok, "\n" + full[len(held):])


def runs_of(seg):
    return [(r.start, r.end) for r in seg.images]


def pad_runs(ids):
    runs, start = [], None
    for i, t in enumerate(ids + [-1]):
        if t == PAD and start is None:
            start = i
        elif t != PAD and start is not None:
            runs.append((start, i))
            start = None
    return runs


def check_identity(traj):
    """The trainer-ingress token check is clean: every action token is what the engine sampled."""
    assert check_tokens(traj) == TokenCheck(0, 0)


def test_openai_sdk_image_turns_with_tools_and_streaming(vl, served):
    tok, _ = vl
    a, b = png(28, 28), png(56, 28, (0, 0, 250))
    eng = ScriptedEngine(tok, [f"Zooming.\n{CALL}", "Two squares.", "A wide one."])
    h = served(eng)
    info = h.create_session()
    c = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
    part = lambda img: {"type": "image_url", "image_url": {"url": data_url(img, "image/png"), "detail": "auto"}}  # noqa: E731
    msgs = [{"role": "user", "content": [{"type": "text", "text": "count"}, part(a)]}]
    r1 = c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
    call = r1.choices[0].message.tool_calls[0]
    assert call.function.name == "zoom" and r1.choices[0].finish_reason == "tool_calls"
    ids1 = r1.choices[0].token_ids
    # what the template renders for image parts is independent of the part's shape: compare with type "image"
    shown = [{"role": "user", "content": [{"type": "text", "text": "count"}, {"type": "image"}]}]
    seg = xp(enc(tok, render(tok, shown, TOOLS)), [4]) + ids1
    assert eng.prompts[0] == seg[:-len(ids1)] and eng.images[0] == [a]
    asst = {"role": "assistant", "content": "Zooming.", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "zoom", "arguments": call.function.arguments}}]}
    msgs += [asst, {"role": "tool", "tool_call_id": call.id, "content": "zoomed"}]
    r2 = c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
    shown2 = shown + [asst, {"role": "tool", "tool_call_id": call.id, "content": "zoomed"}]
    seg += delta(tok, shown + [asst], shown2, TOOLS) + r2.choices[0].token_ids
    # turn 3 streams, with a new image after the text
    msgs += [{"role": "assistant", "content": r2.choices[0].message.content},
             {"role": "user", "content": [{"type": "text", "text": "and this?"}, part(b)]}]
    stream = c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, stream=True)
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    ids3 = [t for ch in chunks if ch.choices for t in (ch.choices[0].model_extra.get("token_ids") or [])]
    assert text == "A wide one." and ids3 == enc(tok, "A wide one.") + [tok.eos_token_id]
    shown3 = shown2 + [{"role": "assistant", "content": "Two squares."},
                       {"role": "user", "content": [{"type": "text", "text": "and this?"}, {"type": "image"}]}]
    seg += xp(delta(tok, shown2 + [{"role": "assistant", "content": "Two squares."}], shown3, TOOLS), [8]) + ids3
    assert eng.images == [[a], [a], [a, b]]
    traj = h.close_session(info.session_id)
    assert len(traj.segments) == 1 and traj.segments[0].token_ids == seg
    s = traj.segments[0]
    assert runs_of(s) == pad_runs(seg) and [r.end - r.start for r in s.images] == [4, 8]
    assert [r.sha256 for r in s.images] == [sha(a), sha(b)] and [r.grid_thw for r in s.images] == [[1, 4, 4], [1, 4, 8]]
    assert traj.images == {sha(a): b64(a), sha(b): b64(b)}
    check_identity(traj)


def test_anthropic_sdk_image_blocks_tool_result_image_streaming(vl, served):
    tok, _ = vl
    a, b = png(28, 28, fmt="JPEG"), png(14, 28, (0, 200, 0))
    eng = ScriptedEngine(tok, [f"Let me zoom.\n{CALL}", "Green."])
    h = served(eng)
    info = h.create_session()
    c = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0)
    img = lambda data, mt: {"type": "image", "source": {"type": "base64", "media_type": mt, "data": b64(data)}}  # noqa: E731
    msgs = [{"role": "user", "content": [img(a, "image/jpeg"), {"type": "text", "text": "what is it?"}]}]
    r1 = c.messages.create(model="policy", max_tokens=64, messages=msgs, tools=A_TOOLS)
    use = next(x for x in r1.content if x.type == "tool_use")
    ids1 = r1.model_extra["token_ids"]
    shown = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    seg = xp(enc(tok, render(tok, shown, TOOLS)), [4]) + ids1
    # the tool result carries an image; this turn streams
    msgs += [{"role": "assistant", "content": [{"type": "text", "text": "Let me zoom."},
                                               {"type": "tool_use", "id": use.id, "name": "zoom", "input": {"x": 1}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": [{"type": "text", "text": "zoomed:"}, img(b, "image/png")]}]}]
    with c.messages.stream(model="policy", max_tokens=64, messages=msgs, tools=A_TOOLS) as st:
        final = st.get_final_message()
    assert final.content[0].text == "Green."
    ids2 = final.model_extra["token_ids"]
    asst = {"role": "assistant", "content": "Let me zoom.", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "zoom", "arguments": {"x": 1}}}]}
    shown2 = shown + [asst, {"role": "tool", "tool_call_id": use.id,
                             "content": [{"type": "text", "text": "zoomed:"}, {"type": "image"}]}]
    seg += xp(delta(tok, shown + [asst], shown2, TOOLS), [2]) + ids2
    traj = h.close_session(info.session_id)
    assert len(traj.segments) == 1 and traj.segments[0].token_ids == seg
    assert runs_of(traj.segments[0]) == pad_runs(seg) == [(r.start, r.end) for r in traj.segments[0].images]
    assert [r.sha256 for r in traj.segments[0].images] == [sha(a), sha(b)]
    assert traj.images == {sha(a): b64(a), sha(b): b64(b)} and eng.images == [[a], [a, b]]
    check_identity(traj)


def test_responses_sdk_input_image_exact(vl, served):
    tok, _ = vl
    a = png(42, 42, (10, 10, 10))
    eng = ScriptedEngine(tok, ["Dark.", "Yes."])
    h = served(eng)
    info = h.create_session()
    c = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
    inp = [{"role": "user", "content": [{"type": "input_text", "text": "shade?"},
                                        {"type": "input_image", "image_url": data_url(a, "image/png"), "detail": "auto"}]}]
    r1 = c.responses.create(model="policy", input=inp)
    assert r1.output_text == "Dark."
    ids1 = r1.model_extra["token_ids"]
    inp += [{"role": "assistant", "content": [{"type": "output_text", "text": "Dark."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "sure?"}]}]
    r2 = c.responses.create(model="policy", input=inp, stream=False)
    shown = [{"role": "user", "content": [{"type": "text", "text": "shade?"}, {"type": "image"}]}]
    seg = xp(enc(tok, render(tok, shown)), [9]) + ids1
    before = shown + [{"role": "assistant", "content": "Dark."}]
    seg += delta(tok, before, before + [{"role": "user", "content": "sure?"}]) + r2.model_extra["token_ids"]
    traj = h.close_session(info.session_id)
    assert traj.segments[0].token_ids == seg and [r.grid_thw for r in traj.segments[0].images] == [[1, 6, 6]]
    assert traj.images == {sha(a): b64(a)}
    check_identity(traj)


R_TOOLS = [{"type": "function", "name": "zoom", "description": "zoom in",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}]


def test_responses_sdk_streaming_tool_call_and_images_in_later_items(vl, served):
    """The Responses wire with images, streamed: turn 1 shows an image and streams a function
    call; turn 2 sends a ``function_call_output`` whose output carries an image, streamed;
    turn 3 is a new user message with a third image. One segment, id for id (runs 4, 2, 9 by
    hand: 28x28, 14x28, 42x42), each image stored once."""
    tok, _ = vl
    a, b, d = png(28, 28), png(14, 28, (0, 200, 0)), png(42, 42, (10, 10, 10))
    eng = ScriptedEngine(tok, [f"Zooming.\n{CALL}", "Green.", "Dark."])
    h = served(eng)
    info = h.create_session()
    c = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
    image = lambda img: {"type": "input_image", "image_url": data_url(img, "image/png"), "detail": "auto"}  # noqa: E731
    inp = [{"role": "user", "content": [{"type": "input_text", "text": "count"}, image(a)]}]
    events = list(c.responses.create(model="policy", input=inp, tools=R_TOOLS, stream=True))
    assert [e.type for e in events if e.type.startswith("response.function_call")] == [
        "response.function_call_arguments.delta", "response.function_call_arguments.done"]
    r1 = events[-1].response
    assert events[-1].type == "response.completed" and [o.type for o in r1.output] == ["message", "function_call"]
    fc = r1.output[1]
    assert (fc.name, fc.arguments) == ("zoom", '{"x": 1}') and r1.output_text == "Zooming."
    ids1 = r1.model_extra["token_ids"]
    assert ids1 == enc(tok, f"Zooming.\n{CALL}") + [tok.eos_token_id]
    shown = [{"role": "user", "content": [{"type": "text", "text": "count"}, {"type": "image"}]}]
    seg = xp(enc(tok, render(tok, shown, TOOLS)), [4]) + ids1
    assert eng.prompts[0] == seg[:-len(ids1)] and eng.images[0] == [a]
    # turn 2: the tool's output is an image (and text), streamed back
    inp += [*[o.model_dump(exclude_none=True) for o in r1.output],
            {"type": "function_call_output", "call_id": fc.call_id,
             "output": [{"type": "input_text", "text": "zoomed:"}, image(b)]}]
    with c.responses.stream(model="policy", input=inp, tools=R_TOOLS) as st:
        r2 = st.get_final_response()
    assert r2.output_text == "Green."
    ids2 = r2.model_extra["token_ids"]
    asst = {"role": "assistant", "content": "Zooming.", "tool_calls": [
        {"id": fc.call_id, "type": "function", "function": {"name": "zoom", "arguments": '{"x": 1}'}}]}
    shown2 = shown + [asst, {"role": "tool", "tool_call_id": fc.call_id,
                             "content": [{"type": "text", "text": "zoomed:"}, {"type": "image"}]}]
    seg += xp(delta(tok, shown + [asst], shown2, TOOLS), [2]) + ids2
    # turn 3: a later user message with a new image, streamed
    inp += [*[o.model_dump(exclude_none=True) for o in r2.output],
            {"role": "user", "content": [image(d), {"type": "input_text", "text": "and this?"}]}]
    events = list(c.responses.create(model="policy", input=inp, tools=R_TOOLS, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Dark."
    ids3 = events[-1].response.model_extra["token_ids"]
    assert ids3 == enc(tok, "Dark.") + [tok.eos_token_id]
    shown3 = shown2 + [{"role": "assistant", "content": "Green."},
                       {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this?"}]}]
    seg += xp(delta(tok, shown2 + [{"role": "assistant", "content": "Green."}], shown3, TOOLS), [9]) + ids3
    assert eng.images == [[a], [a, b], [a, b, d]]
    traj = h.close_session(info.session_id)
    assert len(traj.segments) == 1 and traj.segments[0].token_ids == seg
    s = traj.segments[0]
    assert runs_of(s) == pad_runs(seg) and [r.end - r.start for r in s.images] == [4, 2, 9]
    assert [r.grid_thw for r in s.images] == [[1, 4, 4], [1, 4, 2], [1, 6, 6]]
    assert traj.images == {sha(a): b64(a), sha(b): b64(b), sha(d): b64(d)}
    assert traj.info["requests"] == {"start": 1, "extend": 2, "rewrite": 0, "retry": 0}
    check_identity(traj)


# ------------------------------------------------------------------ refusals (in each wire's shape)


@pytest.fixture()
def app_client(vl):
    tok, vp = vl

    def make(**kw):
        eng = ScriptedEngine(tok)
        app = create_app(eng, tok, vision=vp, **kw)
        tc = TestClient(app)
        sid = app.state.sessions.create().session_id
        key = app.state.sessions._get(sid).api_key
        return eng, tc, sid, {"Authorization": f"Bearer {key}"}

    return make


BAD = {  # name -> (url, base64 data, media type, expected words)
    "undecodable": ("data:image/png;base64," + b64(b"not an image at all"), b64(b"not an image at all"), "image/png",
                    "not an image"),
    "wrong media type": (data_url(png(14, 14, fmt="JPEG"), "image/png"), b64(png(14, 14, fmt="JPEG")), "image/png",
                         "image/jpeg image but the media type says image/png"),
    "unsupported media type": ("data:image/bmp;base64,AAAA", "AAAA", "image/bmp", "'image/bmp' is not supported"),
    "too big": (data_url(png(56, 56), "image/png"), b64(png(56, 56)), "image/png", "over the limit of 100 bytes"),
    "too many pixels": (data_url(png(15, 14), "image/png"), b64(png(15, 14)), "image/png",
                        "the image is 15x14 = 210 pixels, over the limit of 196"),
}
POLICY = {"too big": ImagePolicy(max_bytes=100), "too many pixels": ImagePolicy(max_pixels=196)}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_refused_on_every_wire(app_client, case):
    url, data, mt, words = BAD[case]
    eng, tc, sid, auth = app_client(image_policy=POLICY.get(case))
    # OpenAI Chat
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                                     {"type": "image_url", "image_url": {"url": url}}]}]}
    r = tc.post(f"/s/{sid}/v1/chat/completions", json=body, headers=auth)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["code"] == "invalid_image"
    assert err["param"] == "messages[0].content[1].image_url.url" and words in err["message"]
    # Anthropic Messages
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image", "source": {"type": "base64", "media_type": mt, "data": data}}]}]}
    r = tc.post(f"/s/{sid}/v1/messages", json=body, headers=auth)
    field = "media_type" if case == "unsupported media type" else "data"
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith(f"messages[0].content[1].source.{field}: ") and words in r.json()["error"]["message"]
    # OpenAI Responses
    body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}]}
    r = tc.post(f"/s/{sid}/v1/responses", json=body, headers=auth)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input[0].content[0].image_url" and words in err["message"]
    assert eng.calls == 0  # nothing generated, nothing recorded


def test_remote_urls_refused_unless_allowed(app_client):
    eng, tc, sid, auth = app_client()
    remote = "http://127.0.0.1:9/cat.png"
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": remote}}]}]}
    r = tc.post(f"/s/{sid}/v1/chat/completions", json=body, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].image_url.url"
    assert "allow_remote_urls" in r.json()["error"]["message"]
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": remote}}]}]}
    r = tc.post(f"/s/{sid}/v1/messages", json=body, headers=auth)
    assert r.status_code == 400 and "messages[0].content[0].source.url: remote image URLs are refused" in r.json()["error"]["message"]
    body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}
    r = tc.post(f"/s/{sid}/v1/responses", json=body, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0].file_id"
    body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"},
                                                                 {"type": "input_image", "image_url": remote}]}]}
    r = tc.post(f"/s/{sid}/v1/responses", json=body, headers=auth)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_image" and err["param"] == "input[0].content[1].image_url"
    assert "allow_remote_urls" in err["message"]
    assert eng.calls == 0


def test_remote_url_fetched_when_allowed(app_client):
    img = png(28, 28, (1, 2, 3))

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(img)))
            self.end_headers()
            self.wfile.write(img)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        eng, tc, sid, auth = app_client(image_policy=ImagePolicy(allow_remote_urls=True))
        url = f"http://127.0.0.1:{srv.server_address[1]}/a.png"
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": url}}, {"type": "text", "text": "hi"}]}]}
        r = tc.post(f"/s/{sid}/v1/messages", json=body, headers=auth)
        assert r.status_code == 200, r.text
        assert eng.images == [[img]]
    finally:
        srv.shutdown()
        srv.server_close()


def test_text_only_model_refuses_images(vl):
    tok, _ = vl
    app = create_app(ScriptedEngine(tok), tok)  # the engine has no vision_processor
    tc = TestClient(app)
    sid = app.state.sessions.create().session_id
    auth = {"Authorization": f"Bearer {app.state.sessions._get(sid).api_key}"}
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(14, 14), "image/png")}}]}]}
    r = tc.post(f"/s/{sid}/v1/chat/completions", json=body, headers=auth)
    assert r.status_code == 400 and "no vision processor" in r.json()["error"]["message"]


def test_image_the_processor_refuses_is_a_400_naming_the_field_on_every_wire(app_client):
    """A decodable PNG the model's processor cannot take (Qwen2-VL's ``smart_resize`` refuses an
    aspect ratio >= 200: 300x1 gives 300) is a bad image: a 400 ``invalid_image`` naming the
    image's field on each wire, nothing generated (before: a 400 on ``messages`` blaming
    placeholder tokens in the message text)."""
    bad = png(300, 1)
    url, words = data_url(bad, "image/png"), "image processor refuses this 300x1 image"
    eng, tc, sid, auth = app_client()
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                                     {"type": "image_url", "image_url": {"url": url}}]}]}
    r = tc.post(f"/s/{sid}/v1/chat/completions", json=body, headers=auth)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_image", r.text
    assert err["param"] == "messages[0].content[1].image_url.url" and words in err["message"]
    assert "placeholder" not in err["message"]
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(bad)}}]}]}
    r = tc.post(f"/s/{sid}/v1/messages", json=body, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith("messages[0].content[0].source.data: ") and words in r.text
    body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}]}
    r = tc.post(f"/s/{sid}/v1/responses", json=body, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0].image_url"
    assert eng.calls == 0
