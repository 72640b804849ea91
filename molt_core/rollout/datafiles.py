"""Rows of a dataset split, from a JSONL file, a Parquet file, a local Hugging Face dataset directory
or a Hub dataset name: the one reader behind the ``dataset`` env and ``molt sft --data``
(:func:`load_rows`). ``datasets`` (the extra ``molt-sdk[data]``) is needed only for Parquet,
``save_to_disk`` directories and Hub names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

__all__ = ["BUILTIN_DATASETS_DIR", "Format", "resolve_source", "load_rows", "read_jsonl"]

#: Where ``builtin:NAME`` datasets live (shipped as package data).
BUILTIN_DATASETS_DIR = Path(__file__).resolve().parent.parent / "assets" / "datasets"

Format = Literal["auto", "jsonl", "parquet", "hf"]
_SUFFIX = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def resolve_source(source: str) -> Path | str:
    """``source`` as a local path (``builtin:NAME`` mapped into the package), or itself when none exists (a Hub name).
    Raises: ValueError -- ``builtin:NAME`` names no shipped dataset or file (lists the shipped datasets)."""
    if source.startswith("builtin:"):
        name = source.split(":", 1)[1]
        p = BUILTIN_DATASETS_DIR / name
        if ".." in Path(name).parts or not p.exists():
            have = sorted(d.name for d in BUILTIN_DATASETS_DIR.glob("[!_.]*") if d.is_dir())  # not __pycache__
            raise ValueError(f"{source!r}: no shipped dataset {name!r}; shipped: {', '.join(have) or 'none'}")
        return p
    p = Path(source).expanduser()
    return p if p.exists() else source


def read_jsonl(path: str | Path, what: str = "path") -> list[dict[str, Any]]:
    """The JSON objects of a JSON Lines file, one per non-blank line.
    Raises: ValueError -- a line that is not a JSON object (names ``what``, the file and the 1-based line)."""
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{what} = {str(path)!r}: line {n} is not JSON ({e.msg} at column {e.colno}); "
                                 f"a JSONL file holds one JSON object per line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{what} = {str(path)!r}: line {n} is a JSON {type(row).__name__}, not an object; "
                                 f"each line must be an object such as {{\"prompt\": ..., \"answer\": ...}}")
            rows.append(row)
    return rows


def _datasets(what: str, why: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{what}: {why} needs the `datasets` package; pip install 'molt-sdk[data]'") from None
    return datasets


def _from_hf(ds: Any, what: str, source: Any, split: str) -> list[dict[str, Any]]:
    """Rows of a loaded ``datasets`` object (a ``Dataset``, or a ``DatasetDict`` indexed by ``split``)."""
    if isinstance(ds, dict):  # a DatasetDict (a dict of split name -> Dataset)
        if split not in ds:
            raise ValueError(f"{what} = {str(source)!r} has splits {sorted(ds)}; no split {split!r} "
                             f"(choose one of them)")
        ds = ds[split]
    return [dict(r) for r in ds]


def load_rows(source: str, split: str = "train", fmt: Format = "auto", config: str | None = None,
              what: str = "path") -> list[dict[str, Any]]:
    """The rows (dicts) of ``split`` of ``source``.

    Args:
        source: ``builtin:NAME`` (a shipped dataset directory or ``builtin:NAME/FILE``); a ``.jsonl`` /
            ``.json`` (read with the standard library) or ``.parquet`` file; a ``save_to_disk`` directory,
            else one holding ``SPLIT.jsonl`` / ``SPLIT.parquet``; else a Hub name (``datasets.load_dataset``,
            which reads only the local cache under ``HF_HUB_OFFLINE=1``; nothing here downloads).
        split: the split to read from a directory or a Hub dataset (a single file ignores it).
        fmt: ``auto`` (from the file suffix / directory contents), or force ``jsonl``,
            ``parquet`` or ``hf`` (``load_from_disk`` for a directory, ``load_dataset`` else).
        config: a Hub dataset's configuration name (``load_dataset``'s ``name``).
        what: the option name used in error messages (e.g. ``agent.options.path``).

    Raises:
        ValueError: an unknown suffix, a directory with no dataset or split file, a missing split, an
            uncached Hub name offline, ``datasets`` missing, a malformed JSONL line or Parquet file.
    """
    src = resolve_source(source)
    if isinstance(src, Path) and src.is_file():
        kind = fmt if fmt != "auto" else _SUFFIX.get(src.suffix.lower())
        if kind is None:
            raise ValueError(f"{what} = {source!r}: unknown format {src.suffix or '(no suffix)'!r}; use a .jsonl or "
                             f".parquet file, a dataset directory or a Hub name, or set the format explicitly")
        if kind == "jsonl":
            return read_jsonl(src, what)
        if kind == "parquet":
            ds = _datasets(what, "reading Parquet")
            try:
                table = ds.Dataset.from_parquet(str(src))
            except Exception as e:  # noqa: BLE001 -- pyarrow / datasets raise many types for a bad file
                cause = e.__cause__ or e  # datasets wraps the reader's error
                raise ValueError(f"{what} = {source!r} is not a readable Parquet file ({type(cause).__name__}: "
                                 f"{str(cause)[:200]}); write it again (pandas DataFrame.to_parquet, "
                                 f"datasets Dataset.to_parquet) or give a .jsonl file") from None
            return _from_hf(table, what, source, split)
        raise ValueError(f"{what} = {source!r} is a file; format {kind!r} reads a dataset directory or a Hub name")
    if isinstance(src, Path):  # a directory
        saved = any((src / f).exists() for f in ("dataset_dict.json", "state.json"))
        if fmt == "hf" or (fmt == "auto" and saved):
            ds = _datasets(what, "a directory written by save_to_disk").load_from_disk(str(src))
            if not isinstance(ds, dict) and split != "train":
                raise ValueError(f"{what} = {source!r} holds one Dataset (no named splits), read as split 'train'; "
                                 f"there is no split {split!r}: save a DatasetDict, or hold rows out with eval_fraction")
            return _from_hf(ds, what, source, split)
        kinds = [fmt] if fmt in ("jsonl", "parquet") else ["jsonl", "parquet"]
        for kind in kinds:
            f = src / f"{split}.{kind}"
            if f.is_file():
                return load_rows(str(f), split, kind, what=what)  # type: ignore[arg-type]
        have = sorted(p.name for p in src.iterdir())[:12]
        raise ValueError(f"{what} = {source!r} is a directory with no saved dataset and no {split}.jsonl / "
                         f"{split}.parquet (it holds {have}); name a file, or a directory of SPLIT.jsonl files")
    if fmt in ("jsonl", "parquet"):
        raise ValueError(f"{what} = {source!r}: no such file")
    ds = _datasets(what, f"{source!r} is no local file or directory, so it is read as a Hub dataset name, which")
    try:
        return _from_hf(ds.load_dataset(source, config, split=split), what, source, split)
    except (FileNotFoundError, ConnectionError, OSError) as e:
        import os

        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = (" HF_HUB_OFFLINE is set, so only the local Hugging Face cache is read: download it once "
                "online, or give a local file/directory" if offline else " check the name, or give a local file")
        raise ValueError(f"{what} = {source!r}: no such local file or directory, and the Hub dataset could not be "
                         f"loaded ({type(e).__name__}: {str(e)[:200]}).{hint}") from None
