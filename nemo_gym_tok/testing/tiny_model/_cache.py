"""Cache directories for built models: spec-hashed names, completeness markers, and atomic installs.

Shared by every builder in this package (the embedded tiny model, the per-family test models). A build is written
into a temp dir next to its destination and renamed into place, so a killed build never leaves a directory that
looks complete; a directory is complete when it holds the marker file (with the build's spec hash) and every
required file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.cache_dir import cache_root as cache_root  # the builders' root, re-exported
from nemo_gym_tok.common.exact_json import loads_exact

logger = logging.getLogger(__name__)

# Written last into the temporary build dir; a directory holding it (with a matching hash) is complete.
MARKER_FILE = "ngt_tiny_model.json"

# Partial dirs of builds killed mid-way are removed once they are older than this; a live build takes seconds.
STALE_PARTIAL_SECONDS = 3600.0


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def hash_spec(spec: dict[str, Any]) -> str:
    """Short, stable hash of a JSON-able build spec."""
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:12]


def is_complete(directory: Path, spec_hash: str, required_files: Iterable[str]) -> bool:
    """True if `directory` holds a finished build whose marker names `spec_hash`, with every required file."""
    try:
        marker = loads_exact((directory / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("spec_hash") != spec_hash:
        return False
    return all((directory / name).is_file() for name in (*required_files, MARKER_FILE))


def write_marker(out: Path, spec_hash: str, spec: dict[str, Any]) -> None:
    """Make every file of the build readable by all, then write the completeness marker: call it last, after every
    other file of the build is in `out` (transformers writes weights owner-only; a server running as another user
    must be able to read them)."""
    for path in out.iterdir():
        path.chmod(0o644)
    marker = {"spec_hash": spec_hash, "spec": spec}
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def is_replaceable(directory: Path) -> bool:
    """Only empty dirs and earlier builds of ours may be replaced; never delete a user's unrelated directory."""
    if not directory.exists():
        return True
    if not directory.is_dir():
        return False
    return (directory / MARKER_FILE).is_file() or not any(directory.iterdir())


def remove_stale_partials(dest: Path) -> None:
    """Delete leftovers of killed builds of `dest` (old temp dirs next to it)."""
    now = time.time()
    for leftover in dest.parent.glob(f".{dest.name}.partial-*"):
        try:
            if now - leftover.stat().st_mtime > STALE_PARTIAL_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


def install(built: Path, dest: Path, *, force: bool, complete: Callable[[Path], bool], what: str) -> None:
    """Move the finished temp dir to `dest` with renames, so `dest` is never seen half-written."""
    try:
        os.rename(built, dest)  # atomic; succeeds if dest is absent or an empty directory
        return
    except OSError:
        if not force and complete(dest):
            return  # a concurrent build finished first; ours is discarded by the caller
    if not is_replaceable(dest):
        raise FileExistsError(f"{dest} exists and is not a nemo_gym_tok {what} build; refusing to replace it")
    aside = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(dest, aside)
    try:
        os.rename(built, dest)
    except OSError:
        if not complete(dest):
            raise
    shutil.rmtree(aside, ignore_errors=True)


def build_cached(
    target: Path, *, force: bool, complete: Callable[[Path], bool], write: Callable[[Path], None], what: str
) -> Path:
    """Return `target`, building it with `write(staging_dir)` unless it is `complete` (or `force`).

    `write` fills an existing empty directory and must write the marker last (`write_marker`). Raises
    FileExistsError if `target` is a non-empty directory that is not one of our builds.
    """
    if not force and complete(target):
        return target
    if not is_replaceable(target):
        raise FileExistsError(f"{target} exists and is not a nemo_gym_tok {what} build; refusing to replace it")

    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    # mkdtemp makes it owner-only; a model dir is ordinary readable data (a server may run as another user).
    staging.chmod(0o755)
    logger.info("building %s into %s", what, target)
    try:
        write(staging)
        install(staging, target, force=force, complete=complete, what=what)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
