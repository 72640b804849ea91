"""Checkpoints of a :class:`~molt_core.train.trainer.Trainer` on disk.

A checkpoint is ``<run_dir>/checkpoints/step_<step:08d>/`` (layout: :func:`save_checkpoint`), written
into a temporary directory, renamed and pruned to ``checkpoint.keep``. ``checksums.json`` holds the
SHA-256 of every other file, checked (:func:`verify_checkpoint`) before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from molt_core import _moved
from molt_core.config import ConfigError
from molt_core.train.features import trainer_backend
from molt_core.train.model_files import load_model, load_optimizer, save_model

__all__ = ["CHECKPOINT_DIR", "CheckpointCorrupt", "begin_checkpoint", "commit_checkpoint", "cursor_json",
           "latest_checkpoint", "latest_intact_checkpoint", "list_checkpoints", "load_checkpoint", "save_checkpoint",
           "verify_checkpoint", "write_checkpoint_files"]

_log = logging.getLogger("molt.checkpoint")

CHECKPOINT_DIR = "checkpoints"
_CKPT_PREFIX = "step_"
MANIFEST = "checksums.json"


class CheckpointCorrupt(ValueError):
    """A checkpoint file is missing, truncated or altered; the message names the file."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(d: Path) -> None:
    files = sorted(p for p in d.rglob("*") if p.is_file() and p.name != MANIFEST)
    (d / MANIFEST).write_text(json.dumps({str(p.relative_to(d)): _sha256(p) for p in files}, indent=1))


def verify_checkpoint(d: str | Path) -> dict[str, Any]:
    """Check checkpoint directory ``d`` against its ``checksums.json`` (SHA-256 per file) and
    return its parsed ``state.json``.

    Raises:
        CheckpointCorrupt: a listed file is missing or its SHA-256 differs, ``checksums.json`` or
            ``state.json`` is not valid JSON, or ``state.json`` lacks ``step`` / ``version``.
    """
    d = Path(d)
    fix = "resume from an earlier checkpoint (molt run --resume picks the newest intact one)"
    if (d / MANIFEST).is_file():
        try:
            want = json.loads((d / MANIFEST).read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointCorrupt(f"{d / MANIFEST}: not valid JSON ({e}); {fix}") from None
        for rel, digest in want.items():
            f = d / rel
            if not f.is_file():
                raise CheckpointCorrupt(f"{f}: missing from the checkpoint; {fix}")
            if _sha256(f) != digest:
                raise CheckpointCorrupt(f"{f}: SHA-256 differs from checksums.json (truncated or altered); {fix}")
    try:
        meta = json.loads((d / "state.json").read_text())
        int(meta["step"]), int(meta["version"])
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointCorrupt(f"{d / 'state.json'}: unreadable ({type(e).__name__}: {e}); {fix}") from None
    return meta


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``run_dir/checkpoints``, oldest first (by step).

    A checkpoint is complete once its directory carries its final name; temporary directories
    of a killed writer are ignored.
    """
    d = Path(run_dir) / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        if p.is_dir() and p.name.startswith(_CKPT_PREFIX) and (p / "state.json").is_file():
            try:
                out.append((int(p.name[len(_CKPT_PREFIX):]), p))
            except ValueError:
                continue
    return [p for _, p in sorted(out)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory of ``run_dir``, or None if there is none."""
    cks = list_checkpoints(run_dir)
    return cks[-1] if cks else None


def latest_intact_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of ``run_dir`` that passes :func:`verify_checkpoint`, and the
    reasons the newer ones were skipped (one message per corrupt checkpoint, naming the file).
    Returns ``(path or None, skipped messages)``."""
    skipped: list[str] = []
    for ck in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(ck)
        except CheckpointCorrupt as e:
            skipped.append(str(e))
            continue
        return ck, skipped
    return None, skipped


def save_checkpoint(trainer: Any, run_dir: str | Path, data_cursor: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint of the current state to ``run_dir/checkpoints/step_<step>``; returns it.

    Layout: ``model/`` (``save_pretrained`` safetensors, config, tokenizer, a vision-language
    model's image processor; with an adapter the merged weights plus its files, ``base/`` and
    ``adapter/`` for LoRA), ``ref/`` and ``critic/`` if any, ``trainer_state.pt`` (optimizers (the
    SFT warm start's too while it runs), schedulers, KL controller, RNG states of torch, numpy and
    python), ``state.json`` (``step``, ``version``, ``data_cursor``). A kill leaves the complete checkpoint or none.

    Args:
        run_dir: the run directory. data_cursor: JSON-able position of the data stream.

    Raises:
        TypeError: ``data_cursor`` is not JSON-serialisable.
    """
    cursor = cursor_json(data_cursor)
    final, tmp = begin_checkpoint(run_dir, trainer.step, f"{os.getpid()}")
    write_checkpoint_files(trainer, tmp, cursor)
    return commit_checkpoint(trainer, run_dir, tmp, final)


def cursor_json(data_cursor: dict[str, Any] | None) -> str:
    """``data_cursor`` (None: ``{}``) as JSON text.

    Raises:
        TypeError: it is not JSON-serialisable.
    """
    try:
        return json.dumps(dict(data_cursor or {}))
    except TypeError as e:
        raise TypeError(f"data_cursor must be JSON-serialisable: {e}") from None


def begin_checkpoint(run_dir: str | Path, step: int, tag: str) -> tuple[Path, Path]:
    """``(final, tmp)`` directories of the checkpoint of ``step`` (``tmp`` named with ``tag``,
    made empty): write into ``tmp``, then :func:`commit_checkpoint`."""
    root = Path(run_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_CKPT_PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}-{tag}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return final, tmp


def write_checkpoint_files(trainer: Any, tmp: Path, cursor_json: str, full: dict[str, dict] | None = None,
                           extra: dict[str, Any] | None = None) -> None:
    """Write everything but the manifest into ``tmp``: ``model/`` (+ tokenizer), ``ref/``,
    ``critic/``, ``trainer_state.pt`` and ``state.json`` (see :func:`save_checkpoint`).

    Args:
        full: a sharded trainer's gathered state dicts ``{"model", "ref", "critic"}``, written
            instead of the live modules' own; its optimizer states are then in ``dcp/``.
        extra: more ``state.json`` entries (e.g. ``world_size``).
    """
    full = full or {}
    adapter = trainer.adapter
    if adapter is not None:  # model/ merged and the adapter's files (LoRA: base/ and adapter/)
        adapter.save(trainer.model, tmp)
    else:
        save_model(trainer.model, tmp / "model", full.get("model"))
    if trainer.tokenizer is not None and hasattr(trainer.tokenizer, "save_pretrained"):
        trainer.tokenizer.save_pretrained(tmp / "model")
    if getattr(trainer, "vision_processor", None) is not None:  # preprocessor_config.json: model/ loads as model.path
        trainer.vision_processor.image_processor.save_pretrained(tmp / "model")
    if trainer.ref_model is not None and adapter is None:  # an adapter's reference is its base (adapter disabled)
        save_model(trainer.ref_model, tmp / "ref", full.get("ref"))
    if trainer.critic is not None:
        save_model(trainer.critic, tmp / "critic", full.get("critic"))
    own_optim = not full
    torch.save({
        "optimizer": trainer.optimizer.state_dict() if own_optim else None,
        "scheduler": trainer.scheduler.state_dict(),
        "critic_optimizer": trainer.critic_optimizer.state_dict() if trainer.critic is not None and own_optim else None,
        "critic_scheduler": trainer.critic_scheduler.state_dict() if trainer.critic is not None else None,
        "kl_coef": trainer.kl_coef,
        "kl_controller": trainer.kl_controller.state_dict() if trainer.kl_controller is not None else None,
        "sft_optimizer": sft.state_dict() if (sft := getattr(trainer, "sft_optimizer", None)) and own_optim else None,
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
    }, tmp / "trainer_state.pt")
    (tmp / "state.json").write_text(json.dumps(
        {"step": trainer.step, "version": trainer.version, "data_cursor": json.loads(cursor_json),
         "time": time.time(), **(extra or {})}, indent=1))


def commit_checkpoint(trainer: Any, run_dir: str | Path, tmp: Path, final: Path) -> Path:
    """Manifest, fsync, rename ``tmp`` to ``final``, prune to ``checkpoint.keep``; returns ``final``."""
    root = final.parent
    _write_manifest(tmp)
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-trainer.cfg.checkpoint.keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # left by a writer killed mid-save
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final

def load_checkpoint(trainer: Any, path: str | Path) -> dict[str, Any]:
    """Restore weights, reference, optimizer, scheduler, RNG states, step and version from a checkpoint
    directory (or from the latest checkpoint of a run directory). Returns the ``data_cursor`` saved with it.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointCorrupt: a file of the checkpoint is missing, truncated or altered
            (:func:`verify_checkpoint`; given a run directory, only when none is intact).
    """
    p = Path(path)
    if not (p / "state.json").is_file():
        latest, skipped = latest_intact_checkpoint(p)
        if latest is None:
            if skipped:
                raise CheckpointCorrupt(f"{p}: no intact checkpoint: " + "; ".join(skipped))
            raise FileNotFoundError(f"{p}: not a checkpoint directory and holds no checkpoints/step_* in it")
        p = latest
    meta = verify_checkpoint(p)
    saved_ws, ws = int(meta.get("world_size", 1)), int(getattr(trainer, "world_size", 1))
    if saved_ws != ws:
        msg = f"{p}: written by {saved_ws} trainer ranks, resuming on {ws}: resharding the weights and optimizer state"
        _log.warning(msg)
        if getattr(trainer, "rank", 0) == 0:
            print(f"warning: {msg}", flush=True)
    try:
        _load_checkpoint_files(trainer, p)
    except (CheckpointCorrupt, FileNotFoundError, ConfigError):  # named already (e.g. no critic for algo 'gae')
        raise
    except Exception as e:  # an unverified (pre-checksum) checkpoint that does not load
        raise CheckpointCorrupt(f"{p}: cannot be loaded ({type(e).__name__}: {e}); resume from an earlier "
                                f"checkpoint") from e
    trainer.step = int(meta["step"])
    trainer.version = int(meta["version"])
    trainer.history.clear()  # older versions' weights are not in a checkpoint
    return meta["data_cursor"]


def _load_checkpoint_files(trainer: Any, p: Path) -> None:
    st = torch.load(p / "trainer_state.pt", map_location="cpu", weights_only=False)
    if trainer.critic is not None and not (p / "critic").is_dir():
        raise FileNotFoundError(f"{p}: no critic in this checkpoint, but algo.advantage = 'gae' needs one")
    if st["optimizer"] is None:  # written by a sharded trainer: weights and optimizers in dcp/, read by its backend
        backend = trainer.backend or trainer_backend(trainer.cfg, option=f"resuming the distributed checkpoint {p}")
        backend.load_checkpoint(trainer, p / "dcp")
    else:  # a sharded rank loads the full tensors into its shards (its backend's loaders)
        load_module, load_optim = ((trainer.backend.load_model, trainer.backend.load_optimizer) if trainer.backend
                                   else (load_model, load_optimizer))
        if trainer.adapter is not None:
            trainer.adapter.load(trainer.model, p)
        else:
            load_module(trainer.model, p / "model")
        if (p / "ref").is_dir() and trainer.adapter is None:
            if trainer.ref_model is None:
                trainer.reset_reference()
            load_module(trainer.ref_model, p / "ref")
        load_optim(trainer.model, trainer.optimizer, st["optimizer"])
        if trainer.critic is not None:
            load_module(trainer.critic, p / "critic")
            load_optim(trainer.critic, trainer.critic_optimizer, st["critic_optimizer"])
    trainer.scheduler.load_state_dict(st["scheduler"])
    if trainer.critic is not None:
        trainer.critic_scheduler.load_state_dict(st["critic_scheduler"])
    trainer.kl_coef = float(st["kl_coef"])
    if trainer.kl_controller is not None and st.get("kl_controller") is not None:
        trainer.kl_controller.load_state_dict(st["kl_controller"])
    trainer.sft_resume_state = st.get("sft_optimizer")  # what molt_core.train.sft.warm_start_steps resumes with
    rng = st["rng"]
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def __getattr__(name: str) -> object:
    """``save_sharded_checkpoint`` moved to the FSDP2 plugin (deprecated here)."""
    return _moved.moved_attr(__name__, name)
