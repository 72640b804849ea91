"""Deprecation face of the modules the minimal-core layout moved: importing an old path warns
(``DeprecationWarning`` naming the new one) and returns the module at its new path. The old
paths go in the next minor release (docs/plugins/compatibility.md, "Deprecation")."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED = {
    "molt_core.ledger_render": "molt_core.ledger.render",
    "molt_core.ledger.window_analysis": "molt_plugins.render_window.analysis",
    "molt_core.ledger_messages": "molt_core.ledger.messages",
    "molt_core.ledger_images": "molt_plugins.vision.expand",
    "molt_core.ledger.images": "molt_plugins.vision.expand",
    "molt_core.vision": "molt_plugins.vision.processor",
    "molt_core.images": "molt_plugins.vision.images",
    "molt_core.server.wire_images": "molt_plugins.vision.wire",
    "molt_core.parsers": "molt_plugins.parsers",
    "molt_core.ledger.parsers": "molt_plugins.parsers",
    "molt_core.server.responses": "molt_plugins.wires.responses",
    "molt_core.server.response_store": "molt_plugins.wires.response_store",
    "molt_core.version_history": "molt_core.train.version_history",
    "molt_core.extras": "molt_core.plugins.extras",
    "molt_core.conformance": "molt_core.testing.conformance",
    "molt_core.scaffold": "molt_core.testing.scaffold",
    "molt_core.reward_probe": "molt_core.testing.reward_probe",
    "molt_core.evaluate": "molt_core.cli.evaluate",
    "molt_core.show": "molt_core.cli.show",
    "molt_core.plugin_listing": "molt_core.cli.plugin_listing",
    "molt_core.server.router": "molt_core.cli.router",
    "molt_core.progress": "molt_core.train.progress",
    "molt_core.sft": "molt_core.train.sft",
    "molt_core.tasks": "molt_core.rollout.tasks",
    "molt_core.datafiles": "molt_core.rollout.datafiles",
    "molt_core.evalstats": "molt_core.rollout.evalstats",
    "molt_core._reward_worker": "molt_core.rollout.reward_worker",
    "molt_core.engines.vllm_engine": "molt_plugins.engines.vllm.engine",
    "molt_core.engines.vllm_weight_sync": "molt_plugins.engines.vllm.weight_sync",
    "molt_core.routing": "molt_plugins.moe.routing",
    "molt_core.train.routing_replay": "molt_plugins.moe.routing_replay",
    "molt_core.train.lora": "molt_plugins.lora.adapter",
    "molt_core.train.distributed": "molt_plugins.distributed.sharded",
    "molt_core.train.dist_checkpoint": "molt_plugins.distributed.checkpoint",
}
"""Old dotted module path -> the path it moved to."""

MOVED_NAMES = {
    "molt_core.rewards": {"RewardRunner": "molt_core.rollout.scoring", "score_group": "molt_core.rollout.scoring",
                          "component_metrics": "molt_core.rollout.scoring"},
    "molt_core.server.wires": {n: "molt_plugins.wires.anthropic" for n in (
        "MessagesRequest", "AnthropicTool", "AnthropicMessage", "IGNORED_ANTHROPIC", "REFUSED_ANTHROPIC",
        "anthropic_error", "anthropic_response", "anthropic_stream")},
    "molt_core.algo": {n: "molt_core.train.algorithms" for n in ("compute_advantages", "policy_loss", "apply_correction")},
    "molt_core.ledger.render": {"prove_window": "molt_plugins.render_window"},
    "molt_core.models": {"bigvocab_tokenizer_dir": "molt_plugins.tiny_models.bigvocab",
                         **{n: "molt_plugins.tiny_models.vl" for n in (
                             "TINY_VL_MAX_PIXELS", "TINY_VL_MERGE", "TINY_VL_MIN_PIXELS", "TINY_VL_PATCH")}},
    "molt_core.train.checkpoint": {"save_sharded_checkpoint": "molt_plugins.distributed.checkpoint"},
    "molt_core.config": {n: "molt_core.cli.recipe" for n in (
        "load_config", "validate_config", "apply_overrides", "parse_override", "find_recipe", "recipes_dir",
        "list_recipes", "RECIPES_DIR")},
}
"""Module -> {name that moved out of it: the module it lives in now}."""


def moved_attr(module: str, name: str) -> object:
    """A module ``__getattr__`` body (PEP 562): warn and return ``name`` from its new module.

    Raises:
        AttributeError: ``name`` never lived in ``module``.
    """
    new = MOVED_NAMES.get(module, {}).get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{module}.{name} moved to {new}.{name}: import it from there "
                  "(the old path is removed in the next minor release)", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(new), name)


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Meta-path finder (PEP 451) answering only the old paths in :data:`MOVED`."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        """A spec for an old path; ``None`` (not ours) for every other name."""
        return importlib.machinery.ModuleSpec(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """Warn, then import and return the module at the new path."""
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}: import it from there "
                      "(the old path is removed in the next minor release)", DeprecationWarning, stacklevel=2)
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path is already executed."""


def install() -> None:
    """Put one :class:`MovedFinder` at the end of ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
