"""The driver's side of ``engine.weight_sync = "collective"``: it only orders the calls; the
weights go from the trainer's rank 0 straight into every vLLM worker
(:mod:`molt_core.engines.vllm_weight_sync`), never through the driver or Ray's object store.

Group ranks: 0 is the trainer's rank 0; engine ``i``'s vLLM workers take the next
``sync_world_size`` ranks. Each call launches the receivers first (they block in the engine
between two decode steps), then the trainer, whose call returns once every rank is done.
"""

from __future__ import annotations

from typing import Any

from molt_core.config import RunConfig

__all__ = ["connect", "publish", "resolve_weight_sync"]


def resolve_weight_sync(cfg: RunConfig, local: bool) -> str:
    """``"ray"`` or ``"collective"`` for ``cfg.engine.weight_sync`` (``auto``: collective for the
    vllm engine with ``engine.num_gpus > 0`` in a Ray run).

    Raises:
        ValueError: ``collective`` in a ``--local`` run (the sender and the engines must run at
            once, in separate actors).
    """
    e = cfg.engine
    if e.weight_sync == "collective" and local:
        raise ValueError("engine.weight_sync = \"collective\" needs Ray (the trainer and engines broadcast at once); "
                         "drop --local or set engine.weight_sync = \"ray\"")
    if e.weight_sync == "auto":
        return "collective" if e.name == "vllm" and e.num_gpus > 0 and not local else "ray"
    return e.weight_sync


def connect(ray: Any, trainer: Any, workers: list[Any], timeout_s: float = 600.0) -> str:
    """Form the weight-sync group (the trainer's rank 0 hosts its store); returns its backend.

    Raises:
        RuntimeError: a member failed to join (Ray re-raises its error).
    """
    sizes = ray.get([w.sync_world_size.remote() for w in workers])
    host, port = ray.get(trainer.sync_address.remote())
    world = 1 + sum(sizes)
    offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
    recv = [w.sync_init.remote(host, port, off, world, timeout_s) for w, off in zip(workers, offsets)]
    sent = trainer.sync_init.remote(host, port, world, timeout_s)
    return str(ray.get([sent, *recv])[0])


def publish(ray: Any, trainer: Any, workers: list[Any]) -> int:
    """Broadcast the trainer's current weights into every engine; returns the version loaded.

    Raises:
        ValueError: an engine refused the sync (wrong version, checksum, missing tensor), as
            Ray re-raises it.
    """
    version = int(ray.get(trainer.policy_version.remote()))
    recv = [w.sync_receive.remote(version) for w in workers]
    ray.get([trainer.sync_send.remote(), *recv])
    return version
