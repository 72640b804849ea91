"""First-party wire plugins of the loopback server (``molt_register_wires``): the OpenAI Responses
wire (:mod:`molt_plugins.wires.responses`) and the Anthropic Messages wire
(:mod:`molt_plugins.wires.anthropic`). The kernel serves OpenAI chat completions itself. Entry point ``molt_wires``."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl
from molt_plugins.wires.anthropic import AnthropicWire
from molt_plugins.wires.responses import ResponsesWire


@hookimpl
def molt_register_wires(register):
    """Register ``responses`` (``/v1/responses``) and ``anthropic`` (``/v1/messages``)."""
    register("responses", ResponsesWire())
    register("anthropic", AnthropicWire())
