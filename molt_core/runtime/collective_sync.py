"""The driver's side of a weight-sync transport (``engine.weight_sync = "collective"``): it only orders
the calls; the weights go from the trainer's rank 0 straight into every engine worker through the
transport a plugin registers (``molt_register_weight_sync_transports``), never through the driver.
"""

from __future__ import annotations

from typing import Any

from molt_core.config import ConfigError, RunConfig
from molt_core.plugins import PluginHost, load_plugins

__all__ = ["connect", "publish", "resolve_weight_sync", "worker_transport"]


def resolve_weight_sync(cfg: RunConfig, local: bool, host: PluginHost | None = None) -> str:
    """``"ray"`` or ``"collective"`` for ``cfg.engine.weight_sync`` (``auto``: collective for the vllm engine
    with ``engine.num_gpus > 0`` in a Ray run); with ``host``, a transport other than ``ray`` must be registered.

    Raises:
        ValueError: ``collective`` in a ``--local`` run.
        ConfigError: no plugin of ``host`` registers the transport (names ``engine.weight_sync``).
    """
    e = cfg.engine
    if e.weight_sync == "collective" and local:
        raise ValueError("engine.weight_sync = \"collective\" needs Ray (the trainer and engines broadcast at once); "
                         "drop --local or set engine.weight_sync = \"ray\"")
    mode = e.weight_sync
    if mode == "auto":
        mode = "collective" if e.name == "vllm" and e.num_gpus > 0 and not local else "ray"
    if host is not None and mode != "ray" and mode not in host.names("weight_sync_transports"):
        how = f' resolves to "{mode}" here (the vllm engine on a GPU in a Ray run), but' if e.weight_sync != mode else ":"
        raise ConfigError(
            f'engine.weight_sync = "{e.weight_sync}"{how} no loaded plugin registers the weight-sync transport "{mode}" '
            f"(registered: {', '.join(host.names('weight_sync_transports')) or '(none)'}). molt-sdk's plugin "
            f"molt_engines (molt_plugins.engines) registers it: do not disable it with MOLT_DISABLE_PLUGINS, "
            f'or load a plugin that registers it with --plugin; else set engine.weight_sync = "ray"')
    return mode


def worker_transport(worker: Any, host: PluginHost | None = None) -> Any:
    """The weight-sync transport ``worker.cfg`` resolves to, built once by its plugin's factory and kept on
    ``worker`` (``host``: the worker's plugins, else loaded from ``cfg.plugins``).

    Raises:
        ConfigError: no plugin registers the transport.
        RuntimeError: ``engine.weight_sync`` resolves to ``ray`` (no sync group to join).
    """
    transport = getattr(worker, "_weight_sync_transport", None)
    if transport is None:
        host = host if host is not None else load_plugins(worker.cfg.plugins)
        mode = resolve_weight_sync(worker.cfg, False, host)
        if mode == "ray":
            raise RuntimeError('engine.weight_sync resolves to "ray" here: there is no weight-sync group to join')
        transport = worker._weight_sync_transport = host.get("weight_sync_transports", mode)()
    return transport


def connect(ray: Any, trainer: Any, workers: list[Any], timeout_s: float = 600.0) -> str:
    """Form the weight-sync group (the trainer's rank 0 hosts its store); returns its backend.
    Raises: RuntimeError -- a member failed to join (Ray re-raises its error)."""
    sizes = ray.get([w.sync_world_size.remote() for w in workers])
    host, port = ray.get(trainer.sync_address.remote())
    world = 1 + sum(sizes)
    offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
    recv = [w.sync_init.remote(host, port, off, world, timeout_s) for w, off in zip(workers, offsets)]
    sent = trainer.sync_init.remote(host, port, world, timeout_s)
    return str(ray.get([sent, *recv])[0])


def publish(ray: Any, trainer: Any, workers: list[Any]) -> int:
    """Broadcast the trainer's current weights into every engine; returns the version loaded.
    Raises: ValueError -- an engine refused the sync (wrong version, checksum, missing tensor)."""
    version = int(ray.get(trainer.policy_version.remote()))
    recv = [w.sync_receive.remote(version) for w in workers]
    ray.get([trainer.sync_send.remote(), *recv])
    return version
