"""Images through the ledger: expanded placeholder runs id for id, ImageRefs, images in later
turns, the per-rollout image store (once per distinct image), compaction with image turns, and
memory bounded over a 50-turn image conversation.

Run lengths are computed by hand: the builtin tiny VL processor (patch 7, merge 2) gives an
image of ``w x h`` pixels (multiples of 14, within 14*14..56*56) ``(h / 14) * (w / 14)`` tokens.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import hashlib
import io
import json
import random
import tracemalloc

import pytest
from PIL import Image

from fake_engine import ScriptedEngine
from molt_plugins.vision.images import ImageError, image_part
from molt_core.ledger import Ledger
from molt_core.types import SamplingParams
from molt_plugins.render_window import prove_window

PAD, VSTART, VEND = 514, 512, 513


def png(w: int, h: int, color=(255, 0, 0), noise: int | None = None) -> bytes:
    img = Image.new("RGB", (w, h), color)
    if noise is not None:  # incompressible pixels: the PNG is about w * h * 3 bytes
        rng = random.Random(noise)
        img = Image.frombytes("RGB", (w, h), bytes(rng.getrandbits(8) for _ in range(w * h * 3)))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def expected(tok, msgs, runs, add_generation_prompt=True):
    """encode(render(msgs)) with the k-th <|image_pad|> repeated runs[k] times (by hand)."""
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(PAD) == len(runs)
    out, k = [], 0
    for t in ids:
        if t == PAD:
            out += [PAD] * runs[k]
            k += 1
        else:
            out.append(t)
    return out


def step(led, eng, msgs, params=None):
    params = params or SamplingParams()
    p = led.prepare(msgs, None, params)
    out = asyncio.run(eng.generate(p.prompt_ids, params, images=p.images or None))
    return p, led.commit(p, out, params)


def user(text, *images, first=False):
    parts = [image_part(b) for b in images]
    return {"role": "user", "content": ([{"type": "text", "text": text}] + parts) if not first else parts + [{"type": "text", "text": text}]}


def test_first_turn_image_run_id_for_id(vl):
    tok, vp = vl
    img = png(28, 28)
    led, eng = Ledger(tok, vision=vp), ScriptedEngine(tok, ["two"])
    msgs = [user("how many?", img)]
    p, turn = step(led, eng, msgs)
    want = expected(tok, msgs, [4])
    assert p.mode == "start" and p.prompt_ids == want and eng.prompts[0] == want
    assert eng.images == [[img]]
    i = want.index(PAD)
    assert want[i - 1] == VSTART and want[i + 4] == VEND and want[i:i + 4] == [PAD] * 4
    seg = led.segments()[0]
    assert [(r.sha256, r.start, r.end, r.grid_thw) for r in seg.images] == [(sha(img), i, i + 4, [1, 4, 4])]
    traj = led.trajectory()
    assert traj.images == {sha(img): base64.b64encode(img).decode()}


def test_image_in_a_later_turn_extends_with_an_exact_tail(vl):
    tok, vp = vl
    a, b = png(28, 28), png(56, 42, (0, 0, 255))
    for window in (True, False):
        led, eng = Ledger(tok, vision=vp, window_prover=prove_window if window else None), ScriptedEngine(tok, ["one", "two", "three"])
        msgs = [{"role": "system", "content": "count"}, user("first", a)]
        _, t1 = step(led, eng, msgs)
        msgs += [t1.message(), {"role": "user", "content": "no image here"}]
        _, t2 = step(led, eng, msgs)
        msgs += [t2.message(), user("second", b, first=True)]
        p3, t3 = step(led, eng, msgs)
        assert p3.mode == "extend" and led.counts == {"start": 1, "extend": 2, "rewrite": 0, "retry": 0}
        # the whole segment equals the full render of the conversation, runs expanded by hand
        seg = led.segments()[0]
        want = expected(tok, msgs + [t3.message()], [4, 12], add_generation_prompt=False)
        assert seg.token_ids == want[:len(seg.token_ids)] and len(want) - len(seg.token_ids) == 1  # "\n" after <|im_end|>
        runs = [(r.start, r.end) for r in seg.images]
        pads = [i for i, t in enumerate(seg.token_ids) if t == PAD]
        assert runs == [(pads[0], pads[0] + 4), (pads[4], pads[4] + 12)] and len(pads) == 16
        assert [r.sha256 for r in seg.images] == [sha(a), sha(b)] and seg.images[1].grid_thw == [1, 6, 8]
        assert eng.images == [[a], [a], [a, b]]  # every prompt's images, in token order
        assert p3.image_refs == seg.images[1:]
        assert set(led.trajectory().images) == {sha(a), sha(b)}
        assert sum(led.render_stats.values()) == 2 and led.render_stats["window"] == (1 if window else 0)


def test_same_image_every_turn_is_stored_once(vl):
    tok, vp = vl
    img = png(14, 14)
    led, eng = Ledger(tok, vision=vp), ScriptedEngine(tok)
    msgs: list = []
    for t in range(5):
        msgs = json.loads(json.dumps(msgs + [user(f"turn {t}", img)]))  # a fresh copy, as off the wire
        _, turn = step(led, eng, msgs)
        msgs.append(turn.message())
    seg = led.segments()[0]
    assert len(led.segments()) == 1 and len(seg.images) == 5 and {r.sha256 for r in seg.images} == {sha(img)}
    assert all(r.end - r.start == 1 for r in seg.images)
    traj = led.trajectory()
    assert list(traj.images) == [sha(img)] and len(led._images) == 1
    assert eng.images[-1] == [img] * 5


def test_template_rewriting_an_earlier_image_turn_seals_the_segment(vl):
    """The tiny template drops an earlier assistant's think block once a new user turn follows
    (Qwen3's rewrite): the image segment is sealed and the new one holds both images, id for id."""
    tok, vp = vl
    a, b = png(28, 28), png(42, 28, (0, 255, 0))
    led, eng = Ledger(tok, vision=vp), ScriptedEngine(tok, ["<think>\nhmm\n</think>\n\nthree"])
    msgs = [user("count", a)]
    _, t1 = step(led, eng, msgs)
    msgs += [t1.message(), user("and this?", b)]
    p2, _ = step(led, eng, msgs)
    assert p2.mode == "rewrite"
    s1, s2 = led.segments()
    assert [r.sha256 for r in s1.images] == [sha(a)] and [r.sha256 for r in s2.images] == [sha(a), sha(b)]
    assert p2.prompt_ids == expected(tok, msgs, [4, 6]) == s2.token_ids[:len(p2.prompt_ids)]
    assert [s2.token_ids[r.start:r.end] for r in s2.images] == [[PAD] * 4, [PAD] * 6]
    assert eng.images[1] == [a, b]
    assert set(led.trajectory().images) == {sha(a), sha(b)}
    # re-encoded context: the user turn with its image (4 tokens, not 1) and the assistant turn
    held = msgs[:2]
    assert led.context_reencoded_tokens == len(expected(tok, held, [4], add_generation_prompt=False))


def test_client_compaction_keeps_dropped_images_in_the_sealed_segment(vl):
    tok, vp = vl
    a, b = png(28, 28), png(14, 14, (1, 2, 3))
    led, eng = Ledger(tok, vision=vp), ScriptedEngine(tok, ["x", "y"])
    msgs = [user("look", a)]
    _, t1 = step(led, eng, msgs)
    compacted = [{"role": "user", "content": "summary: one red square"}, user("now this", b)]
    p2, _ = step(led, eng, compacted)
    assert p2.mode == "rewrite"
    s1, s2 = led.segments()
    assert [r.sha256 for r in s1.images] == [sha(a)] and [r.sha256 for r in s2.images] == [sha(b)]
    traj = led.trajectory()
    assert set(traj.images) == {sha(a), sha(b)} and traj.images[sha(b)] == base64.b64encode(b).decode()


def test_retry_of_an_image_turn_records_nothing_twice(vl):
    tok, vp = vl
    led, eng = Ledger(tok, vision=vp), ScriptedEngine(tok, ["x"])
    msgs = [user("look", png(28, 28))]
    step(led, eng, msgs)
    p = led.prepare(json.loads(json.dumps(msgs)), None, SamplingParams())
    assert p.mode == "retry" and len(led.segments()[0].images) == 1


def test_refusals(vl):
    tok, vp = vl
    img = png(28, 28)
    with pytest.raises(ValueError, match="no vision processor"):
        Ledger(tok).prepare([user("x", img)])
    with pytest.raises(ValueError, match="placeholder"):  # text spelling the placeholder token
        Ledger(tok, vision=vp).prepare([user("<|vision_start|><|image_pad|><|vision_end|>", img)])
    with pytest.raises(ValueError, match="placeholder"):
        Ledger(tok, vision=vp).prepare([{"role": "user", "content": "<|image_pad|>"}])
    with pytest.raises(ValueError, match=r"messages\[1\].content\[0\]: images are accepted in user and tool"):
        Ledger(tok, vision=vp).prepare([user("x", img), {"role": "assistant", "content": [image_part(img)]}])
    with pytest.raises(ImageError) as e:
        Ledger(tok, vision=vp).prepare([{"role": "user", "content": [
            {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert e.value.field == "messages[0].content[1].image_url.url"
    with pytest.raises(ImageError, match="allow_remote_urls"):
        Ledger(tok, vision=vp).prepare([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])


def test_text_only_conversations_are_unchanged_by_a_vision_processor(vl):
    tok, vp = vl
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    p1, p2 = Ledger(tok, vision=vp).prepare(msgs), Ledger(tok).prepare(msgs)
    assert p1.prompt_ids == p2.prompt_ids and p1.images == [] and p1.image_refs == []


def _converse(tok, vp, images, turns=50):
    """A ``turns``-turn conversation, each user turn showing ``images[t]``; each request is a
    fresh JSON copy of the whole conversation (as a server decodes it). Returns the ledger."""
    led, eng = Ledger(tok, vision=vp), ScriptedEngine(tok)
    msgs: list = []
    for t in range(turns):
        msgs = json.loads(json.dumps(msgs + [user(f"t{t}", images[t])]))
        p = led.prepare(msgs, None, SamplingParams())
        out = asyncio.run(eng.generate(p.prompt_ids, SamplingParams()))  # images not kept by the engine
        msgs.append(led.commit(p, out).message())
    return led


def _retained(tok, vp, images):
    """Bytes the ledger of a 50-turn conversation over ``images`` retains (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        led = _converse(tok, vp, images)
        vp.clear_cache()  # the processor's own LRU of pixels (bounded separately), not the ledger's
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return held, led


@pytest.mark.slow
def test_ledger_memory_is_bounded_over_50_image_turns(vl, monkeypatch):
    tok, vp = vl
    _converse(tok, vp, [png(14, 14)] * 2, turns=2)  # warm the template facts and caches
    big = png(160, 120, noise=1)  # ~57 KB incompressible; the processor resizes it to 16 tokens
    distinct = [png(160, 120, noise=100 + t) for t in range(50)]
    size = len(big)
    assert size > 50_000 and all(len(d) > 50_000 for d in distinct)
    held_same, led = _retained(tok, vp, [big] * 50)
    n_tokens = len(led.segments()[0].token_ids)
    allowance = 400 * n_tokens + 256 * 1024  # token lists, history text, the last request's parts, ...
    assert len(led._images) == 1
    assert held_same <= size + allowance, (held_same, size, allowance)
    held_distinct, led = _retained(tok, vp, distinct)
    total = sum(len(d) for d in distinct)
    assert len(led._images) == 50 and total <= held_distinct <= total + allowance, (held_distinct, total, allowance)
    # fault injection: a cache that keeps the request's data URLs (one per turn) breaks the bound
    import molt_core.ledger.messages as lm

    monkeypatch.setattr(lm, "_DIGEST_MIN", 1 << 60)
    held_copies, _ = _retained(tok, vp, [big] * 50)
    assert held_copies > 40 * size, held_copies


def test_the_ledger_history_can_be_sent_back(vl):
    """An Env loop sends ``ledger.history`` (canonical image parts, by SHA-256) plus the next
    observation: it extends, and a digest the rollout does not hold is refused."""
    tok, vp = vl
    img = png(28, 28)
    led, eng = Ledger(tok, vision=vp), ScriptedEngine(tok, ["x", "y"])
    step(led, eng, [user("look", img)])
    hist = led.history
    assert hist[0]["content"][1] == {"type": "image", "sha256": sha(img)}
    p, _ = step(led, eng, hist + [user("again", img)])
    assert p.mode == "extend" and eng.images[-1] == [img, img]
    bad = [{"role": "user", "content": [{"type": "image", "sha256": "0" * 64}]}]
    with pytest.raises(ValueError, match="must name an image this rollout already holds"):
        Ledger(tok, vision=vp).prepare(bad)


def test_window_render_equals_full_render_with_images(vl):
    """A longer conversation (images in several turns, a tool round trip): the window-checked
    ledger builds exactly the segments, ImageRefs and engine images of the full-render one."""
    tok, vp = vl
    imgs = [png(14 * (1 + t % 3), 14 * (1 + t % 2), (t * 20, 0, 0)) for t in range(6)]
    call = '<tool_call>\n{"name": "zoom", "arguments": {"x": 1}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "zoom", "parameters": {"type": "object"}}}]
    out = []
    for window in (True, False):
        led = Ledger(tok, vision=vp, window_prover=prove_window if window else None)
        eng = ScriptedEngine(tok, ["a", f"b\n{call}", "c", "d", "e", "f", "g"])
        msgs: list = [{"role": "system", "content": "look"}]
        for t in range(6):
            msgs.append(user(f"u{t}", imgs[t]) if t % 2 == 0 else {"role": "user", "content": f"u{t}"})
            p = led.prepare(msgs, tools, SamplingParams())
            turn = led.commit(p, asyncio.run(eng.generate(p.prompt_ids, SamplingParams(), images=p.images or None)))
            msgs.append(turn.message())
            if turn.tool_calls:
                msgs.append({"role": "tool", "tool_call_id": turn.tool_calls[0]["id"],
                             "content": [{"type": "text", "text": "zoomed"}, image_part(imgs[5])]})
        out.append((led.segments(), eng.images, dict(led.counts), dict(led.render_stats)))
    (seg_w, im_w, counts_w, stats_w), (seg_f, im_f, counts_f, stats_f) = out
    assert seg_w == seg_f and im_w == im_f and counts_w == counts_f == {"start": 1, "extend": 5, "rewrite": 0, "retry": 0}
    assert stats_w["window"] >= 3 and stats_f["window"] == 0
    assert [r.sha256 for r in seg_w[0].images] == [sha(imgs[0]), sha(imgs[5]), sha(imgs[2]), sha(imgs[4])]


def test_a_template_that_drops_an_image_names_the_template_not_the_text(vl):
    """A chat template that renders only text parts gives fewer placeholders than images: the
    refusal says so (before, every count mismatch blamed placeholder tokens in the message text)."""
    import copy

    tok, vp = vl
    text_only = copy.deepcopy(tok)
    text_only.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}"
                               "{{ m.content }}{% else %}{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}"
                               "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match=r"0 image placeholder\(s\) .* but 1 image\(s\) were given \(the chat template "
                                         r"does not render every image part"):
        Ledger(text_only, vision=vp).prepare([user("x", png(28, 28))])
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\) .* but 1 image\(s\) .*message text must not contain"):
        Ledger(tok, vision=vp).prepare([user("<|image_pad|>", png(28, 28))])
