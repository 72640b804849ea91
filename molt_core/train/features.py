"""The trainer's optional features, found in the plugin registries as a third party's would be:
the adapter of ``[trainer.lora]`` (``molt_register_adapters``) and the sharded backend of
``trainer.world_size > 1`` (``molt_register_trainer_backends``). A run without the plugin is
refused here, naming the option and the fix, before any compute."""

from __future__ import annotations

from typing import Any

from molt_core.config import ConfigError, RunConfig
from molt_core.plugins import PluginHost, load_plugins

__all__ = ["ADAPTERS", "SHARDED_BACKEND", "check_trainer_features", "trainer_adapter", "trainer_backend"]

#: ``[trainer]`` option -> (adapter name, first-party plugin module that registers it)
ADAPTERS = {"lora": ("lora", "molt_plugins.lora")}
#: (name, first-party plugin module) of the trainer backend of ``trainer.world_size > 1``
SHARDED_BACKEND = ("fsdp2", "molt_plugins.distributed")


def _missing(option: str, kind: str, name: str, module: str, host: PluginHost, undo: str) -> ConfigError:
    """The error for ``option`` set while no plugin registered ``name`` for ``kind``."""
    known = ", ".join(host.names(kind)) or "none"
    return ConfigError(
        f"{option} needs the {kind[:-1].replace('_', ' ')} {name!r}, which no loaded plugin registers "
        f"(registered: {known}); molt-sdk's first-party plugin {module} provides it: leave it out of "
        f"MOLT_DISABLE_PLUGINS or load it with --plugin {module}, or {undo}", [(option, "no plugin provides it")])


def trainer_adapter(cfg: RunConfig, host: PluginHost | None = None) -> Any:
    """The registered adapter of ``[trainer.lora]``, or None when it is not set.

    Args:
        host: the plugin host; built from the entry points and ``cfg.plugins`` when None and needed.

    Raises:
        ConfigError: ``trainer.lora`` is set but no plugin registers the ``lora`` adapter.
    """
    if cfg.trainer.lora is None:
        return None
    name, module = ADAPTERS["lora"]
    host = host or load_plugins(cfg.plugins)
    if name not in host.registries["adapters"]:
        raise _missing("trainer.lora", "adapters", name, module, host, "remove [trainer.lora]")
    return host.get("adapters", name)


def trainer_backend(cfg: RunConfig, host: PluginHost | None = None, option: str | None = None) -> Any:
    """The registered sharded trainer backend (``fsdp2``), whatever ``trainer.world_size`` (a single
    trainer reads a distributed checkpoint with it).

    Args:
        host: the plugin host; built from the entry points and ``cfg.plugins`` when None.
        option: what needs the backend, for the error (default: ``trainer.world_size = N``).

    Raises:
        ConfigError: no plugin registers it.
    """
    name, module = SHARDED_BACKEND
    host = host or load_plugins(cfg.plugins)
    if name not in host.registries["trainer_backends"]:
        raise _missing(option or f"trainer.world_size = {cfg.trainer.world_size}", "trainer_backends", name, module,
                       host, "set trainer.world_size = 1")
    return host.get("trainer_backends", name)


def check_trainer_features(cfg: RunConfig, host: PluginHost) -> None:
    """Refuse, before any compute, a trainer option whose plugin is not loaded in ``host``.

    Raises:
        ConfigError: see :func:`trainer_adapter` and :func:`trainer_backend` (``trainer.world_size > 1``).
    """
    trainer_adapter(cfg, host)
    if cfg.trainer.world_size > 1:
        trainer_backend(cfg, host)
