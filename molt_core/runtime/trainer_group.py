"""``trainer.world_size`` trainer ranks as one Ray actor handle (sharded data parallelism):
:func:`start_trainer_group` places one :class:`ShardedTrainerWorker` per rank in a packed placement
group and starts each from the ``fsdp2`` trainer backend; the :class:`TrainerGroup` it returns looks
like one trainer actor to the step loop. Notes: docs/architecture.md.
"""

from __future__ import annotations

import socket
from typing import Any

from molt_core.config import RunConfig
from molt_core.models import check_model_positions
from molt_core.runtime.workers import TrainerWorker, where
from molt_core.train.features import trainer_backend

__all__ = ["ShardedTrainerWorker", "TrainerGroup", "describe_ranks", "start_trainer_group"]


class ShardedTrainerWorker(TrainerWorker):
    """One trainer rank: built empty; :meth:`start` joins the process group and builds the rank's trainer
    (:func:`molt_core.train.features.trainer_backend`)."""

    def __init__(self, cfg: RunConfig | dict) -> None:  # noqa: D107 - the trainer is built in start()
        super().__init__(cfg, build=False)

    def rendezvous(self) -> str:
        """A ``tcp://ip:port`` address on this node with a port free now (rank 0 hosts the store)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def start(self, rank: int, world_size: int, init_method: str) -> dict[str, str]:
        """Join the process group as ``rank``, build the sharded trainer; returns ``rank``, :func:`where`, ``backend``.
        Raises: ConfigError -- no plugin registers the trainer backend (names ``trainer.world_size``)."""
        sharded = trainer_backend(self.cfg)
        backend = sharded.init_process_group(rank, world_size, init_method)
        self.trainer = sharded.trainer(self.cfg)
        check_model_positions(self.cfg.model.path, self.trainer.model.config)  # as TrainerWorker does (GGUF)
        return {"rank": str(rank), **where(), "backend": backend}


class _Method:
    def __init__(self, group: "TrainerGroup", name: str, num_returns: int = 1) -> None:
        self.group, self.name, self.num_returns = group, name, num_returns

    def options(self, num_returns: int = 1, **_: Any) -> "_Method":
        return _Method(self.group, self.name, num_returns)

    def remote(self, *args: Any) -> Any:
        return self.group.call(self.name, args, self.num_returns)


class TrainerGroup:
    """The ranks of a sharded trainer behind one actor-like handle: ``group.method.remote(*args)`` runs a
    :class:`TrainerWorker` method on every rank and returns rank 0's ref(s), raising the first rank's error
    (``weights`` returns at once). Attributes: ``actors`` (rank order), ``placements``.
    """

    _NOWAIT = ("weights",)

    def __init__(self, ray: Any, actors: list[Any], placements: list[dict[str, str]]) -> None:
        self.ray, self.actors, self.placements = ray, actors, placements

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def call(self, name: str, args: tuple, num_returns: int = 1) -> Any:
        """Call ``name(*args)`` on every rank; rank 0's ref (or refs, ``num_returns`` > 1)."""
        ray = self.ray
        args = tuple(ray.put(a) for a in args)
        refs = [getattr(a, name).options(num_returns=num_returns).remote(*args) for a in self.actors]
        if name not in self._NOWAIT:
            flat = [r for rr in refs for r in (rr if num_returns > 1 else [rr])]
            pending = flat
            while pending:  # fail fast: the first error of any rank
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done)
        return refs[0]


def start_trainer_group(ray: Any, cfg: RunConfig, cfg_dict: dict) -> TrainerGroup:
    """Place ``trainer.world_size`` ranks in a packed placement group and start them.
    Raises: ValueError -- ``trainer.world_size`` < 2 (use one :class:`TrainerWorker`)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    tc = cfg.trainer
    n = tc.world_size
    if n < 2:
        raise ValueError(f"trainer.world_size = {n}: a trainer group needs 2 or more ranks")
    bundle = {"CPU": tc.num_cpus, **({"GPU": tc.num_gpus} if tc.num_gpus else {})}
    pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
    ray.get(pg.ready())
    cls = ray.remote(ShardedTrainerWorker)
    actors = [cls.options(num_cpus=tc.num_cpus, num_gpus=tc.num_gpus,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                          ).remote(cfg_dict) for i in range(n)]
    url = ray.get(actors[0].rendezvous.remote())
    placements = ray.get([a.start.remote(i, n, url) for i, a in enumerate(actors)])
    return TrainerGroup(ray, actors, placements)


def describe_ranks(ranks: list[dict[str, str]]) -> str:
    """One console line for ``placement.json``'s ``trainer_ranks``, e.g. ``trainer: 2 ranks (gloo): rank 0 on vm
    pid 29030, rank 1 on vm pid 29029``."""
    n = len(ranks)
    backends = sorted({r.get("backend", "none") for r in ranks} - {"none"})
    head = f"trainer: {n} rank{'s' if n != 1 else ''}" + (f" ({', '.join(backends)})" if backends else "")
    return head + ": " + ", ".join(f"rank {r['rank']} on {r['hostname']} pid {r['pid']}" for r in ranks)
