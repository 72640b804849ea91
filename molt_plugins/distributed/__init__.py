"""First-party FSDP2 trainer backend (``trainer.world_size > 1``) and its distributed checkpoints:
``fsdp2`` (:class:`molt_plugins.distributed.sharded.Fsdp2Backend`; ranks and sharding in
:mod:`~molt_plugins.distributed.sharded`, ``dcp/`` checkpoints in :mod:`~molt_plugins.distributed.checkpoint`)."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


@hookimpl
def molt_register_trainer_backends(register):
    """Register ``fsdp2``."""
    from molt_plugins.distributed.sharded import FSDP2  # here: loading the plugins (CLI start-up) imports no torch

    register("fsdp2", FSDP2)
