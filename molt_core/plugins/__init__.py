"""The plugin host: it loads the kernel's built-ins, the ``molt`` entry points (filtered by
``MOLT_DISABLE_PLUGINS`` / ``MOLT_LOAD_PLUGINS``) and each ``--plugin``, and fills the registries.
Every fault (an import error, an unknown hook or argument, a name registered twice) is a
:class:`PluginError` naming plugin and distribution, before any compute."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy

from molt_core import hookspecs
from molt_core.plugins.extras import with_install_hint
from molt_core.hookspecs import PROJECT, REGISTRATION_HOOKS

__all__ = ["PluginError", "PluginInfo", "Registration", "PluginHost", "load_plugins", "shared_host", "unknown_name",
           "modality", "wires", "check_modality_options", "make_tool_parser", "tool_parser"]


class PluginError(RuntimeError):
    """A plugin could not be loaded or validated; the message names the plugin and cause."""


@dataclass
class Registration:
    """One name registered by one plugin for one kind (``rewards``, ``envs``, ...)."""

    kind: str
    name: str
    obj: Any
    plugin: str
    distribution: str


@dataclass
class PluginInfo:
    """What ``molt plugins`` shows for one plugin."""

    name: str
    distribution: str
    version: str
    source: str
    hooks: list[str] = field(default_factory=list)
    registered: dict[str, list[str]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict: ``{name, distribution, version, source, hooks, registered}``."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "source": self.source,
            "hooks": self.hooks,
            "registered": self.registered,
        }


def _disabled() -> set[str]:
    raw = os.environ.get("MOLT_DISABLE_PLUGINS", "")
    return {x.strip() for x in raw.split(",") if x.strip()}


FIRST_PARTY = "molt-sdk"
"""The distribution of the first-party plugins, which ``MOLT_LOAD_PLUGINS`` never filters."""


BUILTIN_ALGO = "molt_algo"
"""The plugin name of :mod:`molt_core.algo.builtins`, which every host registers first."""


def _norm(dist: str) -> str:
    """A distribution name normalised as in PEP 503 (``Molt_SDK`` -> ``molt-sdk``)."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def _allowed() -> set[str] | None:
    """``MOLT_LOAD_PLUGINS`` as a set of names; None when unset (every plugin loads)."""
    raw = os.environ.get("MOLT_LOAD_PLUGINS")
    if raw is None:
        return None
    return {x.strip() for x in raw.split(",") if x.strip()}


def import_path(spec: str, prefix: str = "molt_local_plugin") -> ModuleType:
    """Import ``spec``: a ``.py`` file (as module ``<prefix>_<stem>_<hash>``) or a dotted module path.

    Raises:
        FileNotFoundError: a ``.py`` path that does not exist; any error of the module itself.
    """
    p = Path(spec)
    if spec.endswith(".py") or p.is_file():
        if not p.is_file():
            raise FileNotFoundError(f"no such file: {spec}")
        modname = f"{prefix}_{p.stem}_{abs(hash(str(p.resolve()))) % 10**8}"
        mspec = importlib.util.spec_from_file_location(modname, p)
        assert mspec is not None and mspec.loader is not None
        mod = importlib.util.module_from_spec(mspec)
        sys.modules[modname] = mod
        try:
            mspec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(modname, None)
            raise
        return mod
    return importlib.import_module(spec)


class PluginHost:
    """The pluggy manager, plugin metadata and the registries, ``{kind: {name: Registration}}`` for
    the kinds of :data:`molt_core.hookspecs.REGISTRATION_HOOKS`; built by :func:`load_plugins`."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.registries: dict[str, dict[str, Registration]] = {k: {} for k in REGISTRATION_HOOKS}
        self.local_specs: list[str] = []
        #: the kernel's own hookimpl modules (:data:`BUILTIN_ALGO`): registered, but not in :attr:`infos`
        self.kernel: set[str] = set()

    def _add(self, obj: Any, name: str, dist: str, version: str, source: str, kernel: bool = False) -> None:
        if name in self.infos:
            other = self.infos[name]
            raise PluginError(
                f'plugin name "{name}" from {dist} is already taken by the plugin from '
                f"{other.distribution} ({other.source}); rename one entry point"
            )
        unknown = [
            a for a in dir(obj)
            if a.startswith("molt_") and callable(getattr(obj, a, None))
            and not hasattr(self.pm.hook, a)
        ]
        if unknown:
            raise PluginError(
                f'plugin "{name}" ({dist}) implements unknown hook(s) {", ".join(sorted(unknown))}; '
                f"this molt-sdk speaks hook API version {hookspecs.HOOK_API_VERSION} "
                f"(hooks: {', '.join(sorted(h for h in dir(self.pm.hook) if h.startswith('molt_')))})"
            )
        try:
            self.pm.register(obj, name=name)
        except pluggy.PluginValidationError as e:
            detail = " ".join(str(e).split())
            raise PluginError(f'plugin "{name}" ({dist}) has an invalid hook implementation: {detail}') from e
        if kernel:
            self.kernel.add(name)
            return
        hooks = sorted(
            c.name for c in (self.pm.get_hookcallers(obj) or [])
        )
        self.infos[name] = PluginInfo(name=name, distribution=dist, version=version, source=source, hooks=hooks)

    def load_entry_points(self) -> None:
        """Load every ``molt`` entry point not in ``MOLT_DISABLE_PLUGINS`` (entry-point or distribution
        names); when ``MOLT_LOAD_PLUGINS`` is set (``""``: none), only the third-party ones it lists.
        First-party entry points load unless disabled; the deny list wins.

        Raises:
            PluginError: an entry point fails or is invalid, or ``MOLT_LOAD_PLUGINS`` names no plugin.
        """
        disabled, allowed = _disabled(), _allowed()
        eps = sorted(md.entry_points(group=PROJECT), key=lambda e: e.name)
        if allowed:
            known = {ep.name for ep in eps} | {ep.dist.name for ep in eps if ep.dist is not None}
            missing = sorted(allowed - known)
            if missing:
                raise PluginError(
                    f"MOLT_LOAD_PLUGINS names {', '.join(missing)}, not an installed molt plugin "
                    f"(installed: {', '.join(sorted(ep.name for ep in eps))})"
                )
        for ep in eps:
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            if ep.name in disabled or dist in disabled:
                continue
            if allowed is not None and _norm(dist) != FIRST_PARTY and ep.name not in allowed and dist not in allowed:
                continue
            try:
                obj = ep.load()
            except Exception as e:
                raise PluginError(with_install_hint(
                    f'Error importing plugin "{ep.name}" (distribution {dist} {version}, '
                    f"{ep.value}): {type(e).__name__}: {e}", e
                )) from e
            self._add(obj, ep.name, dist, version, ep.value)

    def load_local(self, spec: str) -> None:
        """Load an uninstalled plugin (``--plugin``): dotted module path or ``.py`` file path.

        Raises:
            PluginError: the module cannot be imported or is invalid.
        """
        try:
            mod = import_path(spec)
        except Exception as e:
            raise PluginError(with_install_hint(f'Error importing plugin "{spec}" (--plugin): {type(e).__name__}: {e}', e)) from e
        self.local_specs.append(spec)
        self._add(mod, spec, "not installed", "-", spec)

    def collect(self) -> None:
        """Call every registration hook, filling the registries.

        Raises:
            PluginError: two plugins register one name for one kind, or a hook raises.
        """
        for kind, hook_name in REGISTRATION_HOOKS.items():
            caller = getattr(self.pm.hook, hook_name)
            for impl in reversed(caller.get_hookimpls()):
                plugin = impl.plugin_name
                info = self.infos.get(plugin)
                dist = info.distribution if info else FIRST_PARTY if plugin in self.kernel else "?"

                def register(name: str, obj: Any, _plugin: str = plugin, _dist: str = dist, _kind: str = kind) -> None:
                    if not isinstance(name, str) or not name:
                        raise PluginError(f'plugin "{_plugin}" ({_dist}) registered a {singular(_kind)} with an empty or non-string name')
                    reg = self.registries[_kind]
                    if name in reg:
                        prev = reg[name]
                        raise PluginError(
                            f'{singular(_kind)} name "{name}" is registered twice: by plugin "{prev.plugin}" '
                            f'({prev.distribution}) and by plugin "{_plugin}" ({_dist}); '
                            f"disable one with MOLT_DISABLE_PLUGINS"
                        )
                    reg[name] = Registration(_kind, name, obj, _plugin, _dist)
                    if info is not None:
                        info.registered.setdefault(_kind, []).append(name)

                kwargs = {a: register for a in impl.argnames if a == "register"}
                try:
                    impl.function(**kwargs)
                except PluginError:
                    raise
                except Exception as e:
                    raise PluginError(f'plugin "{plugin}" ({dist}) failed in {hook_name}: {type(e).__name__}: {e}') from e

    def get(self, kind: str, name: str) -> Any:
        """Return the object registered as ``name`` for ``kind``.

        Raises:
            KeyError: no such name (message: :func:`unknown_name`).
        """
        reg = self.registries[kind]
        if name not in reg:
            raise KeyError(unknown_name(kind, name, list(reg)))
        return reg[name].obj

    def names(self, kind: str) -> list[str]:
        """Sorted registered names of ``kind``."""
        return sorted(self.registries[kind])

    def plugin_registries(self) -> dict[str, dict[str, Registration]]:
        """:attr:`registries` less the kernel's own built-ins (what ``molt plugins`` lists and checks)."""
        return {k: {n: r for n, r in reg.items() if r.plugin not in self.kernel} for k, reg in self.registries.items()}

    def configure(self, config: Any) -> None:
        """Broadcast ``molt_configure(config)`` (historic)."""
        self.pm.hook.molt_configure.call_historic(kwargs={"config": config})

    def on_trajectory(self, trajectory: Any) -> None:
        """Broadcast ``molt_on_trajectory(trajectory)``."""
        self.pm.hook.molt_on_trajectory(trajectory=trajectory)

    def on_step_end(self, step: int, metrics: dict) -> None:
        """Broadcast ``molt_on_step_end(step, metrics)``."""
        self.pm.hook.molt_on_step_end(step=step, metrics=metrics)

    def plugin_infos(self) -> list[PluginInfo]:
        """Plugin metadata, sorted by name."""
        return [self.infos[k] for k in sorted(self.infos)]


def singular(kind: str) -> str:
    """A registry kind in the singular: ``rewards`` -> ``reward``, ``losses`` -> ``loss``."""
    return kind[:-2] if kind.endswith("sses") else kind[:-1]


def unknown_name(kind: str, name: str, known: list[str]) -> str:
    """The message for an unregistered ``kind`` ``name``: the closest and every registered name, and
    how to load a plugin (``--plugin FILE.py`` or installing its package)."""
    import difflib

    what = singular(kind).replace("_", " ")
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"no {what} named {name!r}{hint}; registered: {', '.join(sorted(known)) or '(none)'}. "
            f"{'An' if what[0] in 'aeiou' else 'A'} {what} from another package loads with --plugin FILE.py (or a dotted module path), or by "
            f"pip install-ing the package that provides it (an entry point in group `{PROJECT}`)")


def load_plugins(local: list[str] | tuple[str, ...] = (), entry_points: bool = True) -> PluginHost:
    """Build a :class:`PluginHost`: entry points, then ``local`` specs, then registries.

    Args:
        local: ``--plugin`` values (dotted module paths or ``.py`` file paths).
        entry_points: load the installed ``molt`` entry points (False in isolated tests).

    Raises:
        PluginError: any fault of a plugin (the module docstring lists them).
    """
    from molt_core.algo import builtins as algo_builtins  # torch: not at CLI start-up (molt --help)

    host = PluginHost()
    host._add(algo_builtins, BUILTIN_ALGO, FIRST_PARTY, "", algo_builtins.__name__, kernel=True)
    if entry_points:
        host.load_entry_points()
    for spec in local:
        host.load_local(spec)
    host.collect()
    return host


_RUN_PLUGINS: tuple[str, ...] = ()


def use_run_plugins(local: list[str] | tuple[str, ...]) -> None:
    """Make ``local`` (the run's ``--plugin`` list) what :func:`shared_host` loads by default in this
    process (called by the run's actors and trainer)."""
    global _RUN_PLUGINS
    _RUN_PLUGINS = tuple(local)


def shared_host(local: list[str] | tuple[str, ...] | None = None) -> PluginHost:
    """The :func:`load_plugins` host of ``local`` (None: :func:`use_run_plugins`'s list), cached per
    list and plugin env vars, for kernel code handed no host. Read it; never mutate it.

    Raises:
        PluginError: as :func:`load_plugins`.
    """
    local = _RUN_PLUGINS if local is None else local
    return _shared_host(tuple(local), os.environ.get("MOLT_DISABLE_PLUGINS"), os.environ.get("MOLT_LOAD_PLUGINS"))


@functools.lru_cache(maxsize=16)
def _shared_host(local: tuple[str, ...], _disabled: str | None, _allowed: str | None) -> PluginHost:
    return load_plugins(local)


def _first(kind: str, host: PluginHost | None) -> Any:
    reg = (host or shared_host()).registries[kind]
    return reg[min(reg)].obj if reg else None


def modality(host: PluginHost | None = None) -> Any:
    """The first registered modality by name, or None (text only); ``host``: default :func:`shared_host`.
    Raises: PluginError -- as :func:`load_plugins` when the shared host is built."""
    return _first("modalities", host)


def window_prover(host: PluginHost | None = None) -> Any:
    """The first registered window prover by name, or None (full renders); ``host`` as :func:`modality`.
    Raises: PluginError -- as :func:`load_plugins` when the shared host is built."""
    return _first("render_windows", host)


def make_tool_parser(name: Any, tokenizer: Any, parsers: dict[str, Any]) -> Any:
    """``parsers[name]`` built for ``tokenizer`` (``cls.for_tokenizer(tokenizer)`` or ``cls()``), or
    ``name`` itself when it is already a parser.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if not isinstance(name, str):
        return name
    if name not in parsers:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(parsers)) or '(none)'}")
    make = getattr(parsers[name], "for_tokenizer", None)
    return make(tokenizer) if make is not None else parsers[name]()


def tool_parser(name: Any, tokenizer: Any = None, host: PluginHost | None = None) -> Any:
    """The registered tool parser ``name`` built for ``tokenizer`` (or ``name``, already a parser),
    for a :class:`~molt_core.ledger.Ledger`; ``host`` as :func:`modality`.

    Raises:
        ValueError: no plugin registered ``name`` (lists the registered ones and the fix).
    """
    if not isinstance(name, str):
        return name
    reg = (host or shared_host()).registries["tool_parsers"]
    if name not in reg:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(reg)) or '(none)'}. A model "
                         "family's tool parser comes from a plugin (molt_register_tool_parsers; first party: "
                         "molt_plugins.parsers, entry point molt_parsers: unset "
                         "MOLT_DISABLE_PLUGINS=molt_parsers, or reinstall molt-sdk from its checkout) or --plugin")
    return make_tool_parser(name, tokenizer, {name: reg[name].obj})


def wires(host: PluginHost | None = None) -> dict[str, Any]:
    """The registered wires, ``{name: wire}`` in registration order; ``host`` as :func:`modality`."""
    return {n: r.obj for n, r in (host or shared_host()).registries["wires"].items()}


def check_modality_options(config: Any, host: PluginHost) -> None:
    """Refuse a recipe that sets ``[images]`` (to other than its defaults) with no modality plugin loaded.

    Raises:
        PluginError: naming ``images`` and the fix.
    """
    if "images" in config.model_fields_set and config.images != type(config.images)() and modality(host) is None:
        raise PluginError("images: the recipe sets [images] but no modality plugin is loaded (images need one); "
                          "enable molt_plugins.vision (unset MOLT_DISABLE_PLUGINS=molt_vision, or reinstall molt-sdk from its checkout) "
                          "or remove the [images] section")
