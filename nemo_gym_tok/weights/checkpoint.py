"""What a push is given, checked before any server changes: a checkpoint directory vLLM can reload, a version label."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nemo_gym_tok.common.exact_json import loads_exact

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
MAX_VERSION_CHARS = 128


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory as the servers will be told it (absolute when it exists here)."""

    path: str
    tie_word_embeddings: bool | None
    """From its config.json; None when the directory is not on this machine (a path on the servers' side)."""


def check_checkpoint_dir(directory: str | Path) -> Checkpoint:
    """The directory, checked where it can be: on this machine it must hold a config.json and weight files; a path
    that does not exist here is passed on as it is (it may be a path on the servers' machines: their reload then
    names what is wrong)."""
    path = Path(directory).expanduser()
    if not path.exists():
        return Checkpoint(str(directory), None)
    if not path.is_dir():
        raise ValueError(f"{directory} is not a directory; give the directory `save_pretrained` wrote")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json: give the directory `save_pretrained` wrote")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise ValueError(f"{path} holds no weights ({', '.join(WEIGHT_PATTERNS)})")
    try:
        config = loads_exact(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file} is not readable JSON: {exc}") from exc
    tied = config.get("tie_word_embeddings") if isinstance(config, dict) else None
    return Checkpoint(str(path.resolve()), bool(tied) if tied is not None else None)


def check_version_label(version: object) -> str:
    """`version` as vLLM's label: a non-empty printable string without spaces (an int is taken as its digits)."""
    if isinstance(version, int) and not isinstance(version, bool):
        version = str(version)
    if not isinstance(version, str) or not version:
        raise ValueError(f"version must be a non-empty string, got {version!r}")
    if len(version) > MAX_VERSION_CHARS or not all("!" <= char <= "~" for char in version):
        raise ValueError(f"version must be printable ASCII without spaces, at most {MAX_VERSION_CHARS} characters")
    return version
