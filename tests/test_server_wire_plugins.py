"""The Responses and Anthropic wires are plugins (``molt_register_wires``): the first-party ones
register through the host like a third party's; a server without them answers their paths with
the 404 an unknown route gets, naming the missing wire plugin; a third-party wire mounts its own
route through the same :class:`~molt_core.server.app.WireServer`."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fake_engine import EchoEngine
from molt_core.hookspecs import REGISTRATION_HOOKS
from molt_core.models import load_tokenizer
from molt_core.plugins import shared_host, wires
from molt_core.server import create_app
from molt_core.server.wires import WireError, WireRequest
from molt_plugins.wires.anthropic import AnthropicWire
from molt_plugins.wires.responses import ResponsesWire


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen3")


def session(app):
    c = TestClient(app)
    info = c.post("/sessions", headers={"x-api-key": "adm"}).json()
    return c, info, {"x-api-key": info["api_key"]}


def test_first_party_wires_register_through_the_hook():
    assert REGISTRATION_HOOKS["wires"] == "molt_register_wires"
    reg = shared_host().registries["wires"]
    assert list(reg) == ["responses", "anthropic"] and {r.plugin for r in reg.values()} == {"molt_wires"}
    got = wires()
    assert isinstance(got["responses"], ResponsesWire) and isinstance(got["anthropic"], AnthropicWire)


@pytest.mark.parametrize("path, wire", [("/v1/messages", "Anthropic Messages"), ("/v1/responses", "OpenAI Responses")])
def test_without_the_wire_plugin_its_path_is_a_404_naming_it(tok, path, wire):
    app = create_app(EchoEngine(tok), tok, admin_key="adm", wires={})
    c, info, key = session(app)
    sid = info["session_id"]
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
    r = c.post(f"/s/{sid}{path}", headers=key, json=body)
    unknown = c.post(f"/s/{sid}/v1/embeddings", headers=key, json={})
    assert r.status_code == unknown.status_code == 404
    err = r.json()["error"]
    assert set(r.json()) == set(unknown.json()) == {"error"} and set(err) == set(unknown.json()["error"])
    assert (err["type"], err["param"], err["code"]) == ("not_found_error", None, "not_found")
    assert err["message"].startswith(f"no route /s/{sid}{path}: the {wire} wire is not loaded")
    assert "molt_register_wires" in err["message"] and "molt_plugins.wires" in err["message"]
    # what the kernel serves without it
    assert unknown.json()["error"]["message"] == (f"no route /s/{sid}/v1/embeddings (a session serves "
                                                  "/v1/chat/completions and /v1/models)")
    ok = c.post(f"/s/{sid}/v1/chat/completions", headers=key, json={"messages": [{"role": "user", "content": "hi"}],
                                                                    "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"]


class _EchoReq(WireRequest):
    text: str

    def check(self) -> None:
        """Nothing beyond the model's own validation."""


class EchoWire:
    """A third party's wire: ``POST /s/{sid}/v1/echo`` runs one turn; errors in its own shape."""

    paths = ("/v1/echo",)

    @staticmethod
    def error_body(status, message, param=None, code=None):
        return {"oops": message, "status": status}

    def mount(self, server):
        @server.route("/s/{sid}/v1/echo")
        async def echo(sid, request):
            async def handle():
                s, req, size = await server.session_request(request, sid, _EchoReq)
                if not req.text:
                    raise WireError(400, "text is empty", "text")
                turn = await server.run_turn(s, request, [{"role": "user", "content": req.text}], None,
                                             server.params_of(None, None, None, 0, []), 3, True, size)
                return {"text": turn.content, "ids": list(turn.token_ids), "state": s.state.setdefault("n", 0)}

            return await server.guarded(self, handle)


def test_a_third_party_wire_mounts_through_the_same_context(tok):
    app = create_app(EchoEngine(tok), tok, admin_key="adm", wires={"echo": EchoWire()})
    c, info, key = session(app)
    sid = info["session_id"]
    r = c.post(f"/s/{sid}/v1/echo", headers=key, json={"text": "hi"})
    assert r.status_code == 200 and r.json()["ids"] and r.json()["state"] == 0
    assert len(app.state.sessions.trajectory(sid).segments) == 1
    bad = c.post(f"/s/{sid}/v1/echo", headers=key, json={"text": ""})
    assert (bad.status_code, bad.json()) == (400, {"oops": "text is empty", "status": 400})
    assert c.post(f"/s/{sid}/v1/echo", json={"text": "x"}).status_code == 401
    un = c.post(f"/s/{sid}/v1/nope", headers=key, json={}).json()["error"]["message"]
    assert un.endswith("(a session serves /v1/chat/completions, /v1/echo and /v1/models)")
