"""The model families' tool-call parsers are a first-party plugin (molt_plugins.parsers, hook
``molt_register_tool_parsers``): the server and ``molt serve`` resolve a name through the
registry once; the ledger keeps only the protocol and its Hermes default (no lookup); a family
whose parser no plugin registered is refused naming it and the plugin."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from click.testing import CliRunner

import molt_core.plugins as plugins
import molt_core.server.app as app_mod
from fake_engine import ScriptedEngine
from molt_core.cli import main
from molt_core.ledger import Ledger
from molt_core.ledger.toolcall import HermesParser, ParsedCall
from molt_core.models import load_tokenizer
from molt_core.plugins import load_plugins, tool_parser
from molt_core.server import create_app
from molt_plugins.parsers import TOOL_PARSERS, AutoParser, Llama3JsonParser, Qwen3CoderParser

FAMILIES = ["auto", "hermes", "llama3_json", "mistral", "qwen", "qwen3_coder"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen3")


def test_the_plugin_registers_every_family_through_the_hook():
    host = load_plugins()
    assert host.names("tool_parsers") == FAMILIES
    assert {n: host.get("tool_parsers", n) for n in FAMILIES} == TOOL_PARSERS
    assert all(r.plugin == "molt_parsers" for r in host.registries["tool_parsers"].values())
    assert type(tool_parser("llama3_json", host=host)) is Llama3JsonParser
    assert type(tool_parser("qwen", host=host)) is HermesParser
    # auto: chosen per model from its tokenizer (for_tokenizer); bare, it is Hermes
    coder = SimpleNamespace(chat_template="<function={{ name }}>")
    assert type(tool_parser("auto", coder, host=host)) is Qwen3CoderParser
    assert type(tool_parser("auto", SimpleNamespace(chat_template="x"), host=host)) is HermesParser
    assert isinstance(AutoParser(), HermesParser)
    obj = Llama3JsonParser()
    assert tool_parser(obj, host=host) is obj  # a parser object is handed through


def test_a_family_without_its_plugin_is_refused_naming_it_and_the_plugin():
    bare = load_plugins(entry_points=False)
    with pytest.raises(ValueError, match=r"unknown tool parser 'llama3_json'; known: \(none\)\. A model family's tool "
                                         r"parser comes from a plugin \(molt_register_tool_parsers; first party: "
                                         r"molt_plugins.parsers"):
        tool_parser("llama3_json", host=bare)
    with pytest.raises(ValueError, match="unknown tool parser 'nope'; known: auto, hermes, llama3_json, mistral, qwen, "
                                         "qwen3_coder. A model family's tool parser comes from a plugin"):
        tool_parser("nope", host=load_plugins())


def test_server_without_the_parsers_plugin_refuses_a_named_family(tok, monkeypatch):
    monkeypatch.setenv("MOLT_DISABLE_PLUGINS", "molt_parsers")
    with pytest.raises(ValueError, match="unknown tool parser 'qwen3_coder'.*molt_plugins.parsers"):
        create_app(ScriptedEngine(tok, ["x"]), tok, tool_parser="qwen3_coder")


def test_molt_serve_without_the_parsers_plugin_refuses_before_loading_a_model(monkeypatch):
    import molt_core.engines.transformers_engine as te

    loaded = []
    monkeypatch.setattr(te, "TransformersEngine", lambda *a, **k: loaded.append(a))
    r = CliRunner().invoke(main, ["serve", "--model", "m", "--tool-parser", "hermes"],
                           env={"MOLT_DISABLE_PLUGINS": "molt_parsers"})
    assert r.exit_code == 2 and loaded == []
    out = " ".join(r.output.split())
    assert "--tool-parser hermes: no tool-parser plugin is loaded (molt_register_tool_parsers; first party: " \
           "molt_plugins.parsers, entry point molt_parsers" in out


def test_the_ledger_and_a_server_with_no_parser_named_look_nothing_up(tok, monkeypatch):
    def no_lookup(*a, **k):
        raise AssertionError("no registry lookup without a named parser")

    monkeypatch.setattr(plugins, "shared_host", no_lookup)
    monkeypatch.setattr(app_mod, "registered_tool_parser", no_lookup)
    led = Ledger(tok)
    assert type(led.tool_parser) is HermesParser
    assert led.tool_parser.parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>') == [
        ParsedCall("f", {}, (0, 53))]
    create_app(ScriptedEngine(tok, ["x"]), tok, modality=None, wires={}, window_prover=None)  # all named: no lookup


def test_the_ledger_takes_a_parser_not_a_name(tok):
    with pytest.raises(ValueError, match=r"Ledger\(tool_parser='hermes'\): pass a parser, not a name; resolve the name "
                                         r"with molt_core.plugins.tool_parser"):
        Ledger(tok, tool_parser="hermes")
    p = Qwen3CoderParser()
    assert Ledger(tok, tool_parser=p).tool_parser is p


def test_a_third_party_family_registers_through_the_same_hook(tmp_path):
    f = tmp_path / "my_parser.py"
    f.write_text(
        "from molt_core.hookspecs import hookimpl\n"
        "from molt_core.ledger.toolcall import ParsedCall\n\n"
        "class Bang:\n"
        "    '''Calls written as !name.'''\n\n"
        "    def parse(self, text, start=0, tools=None):\n"
        "        return [ParsedCall(text[start + 1:].strip(), {}, (start, len(text)))] if text[start:].startswith('!') else []\n\n"
        "@hookimpl\n"
        "def molt_register_tool_parsers(register):\n"
        "    register('bang', Bang)\n")
    host = load_plugins([str(f)])
    assert "bang" in host.names("tool_parsers")
    assert [(c.name, c.span) for c in tool_parser("bang", host=host).parse("!go")] == [("go", (0, 3))]
