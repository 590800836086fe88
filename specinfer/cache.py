"""The export cache: checkpoints given where an export is needed are exported once, into
``$SPECINFER_CACHE/onnx/<key>`` (default ``~/.cache/specinfer``), keyed by their content, so that
every clone or copy of the same checkpoint shares one export.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

MIB = 1 << 20
WHOLE_FILE_BYTES = 8 * MIB   # files up to this size are hashed whole; larger ones by three 1 MiB samples


def cache_dir() -> Path:
    return Path(os.environ.get("SPECINFER_CACHE", Path.home() / ".cache" / "specinfer"))


def _fingerprint(path: Path) -> str:
    """A file's name, size and content hash (of its start, middle and end when large: hashing
    gigabytes of weights at every load would cost more than it saves)."""
    size, h = path.stat().st_size, hashlib.sha1()
    with path.open("rb") as f:
        if size <= WHOLE_FILE_BYTES:
            h.update(f.read())
        else:
            for offset in (0, size // 2, size - MIB):
                f.seek(offset)
                h.update(f.read(MIB))
    return f"{path.name}:{size}:{h.hexdigest()}"


def export_folder(model_dir: Path, max_context: int | None, export_format: str) -> Path:
    """Where the export of the checkpoint in ``model_dir`` lives in the cache: the key changes
    whenever the checkpoint's files, the context or the export format change."""
    stamp = [str(max_context), export_format] + sorted(_fingerprint(p) for p in model_dir.iterdir() if p.is_file())
    return cache_dir() / "onnx" / hashlib.sha1("|".join(stamp).encode()).hexdigest()[:16]


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def cached_exports() -> list[dict]:
    """Every export in the cache: folder, source checkpoint, format, max context and bytes."""
    root = cache_dir() / "onnx"
    rows = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
        except (OSError, ValueError):
            manifest = {}   # an export that did not finish
        rows.append({"folder": folder, "source": manifest.get("source", "?"), "format": manifest.get("format", "?"),
                     "max_context": manifest.get("max_context"), "bytes": _size(folder)})
    return rows


def clear(stale_only: bool = False, current_format: str | None = None) -> tuple[int, int]:
    """Remove cached exports (``stale_only``: those of another export format than
    ``current_format``, or unfinished); returns (exports removed, bytes freed)."""
    removed = freed = 0
    for row in cached_exports():
        if stale_only and row["format"] == current_format:
            continue
        shutil.rmtree(row["folder"], ignore_errors=True)
        removed, freed = removed + 1, freed + row["bytes"]
    return removed, freed
