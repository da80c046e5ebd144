"""The one error type config loading raises: a single line naming the file and the key."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config problem the user must fix; `str()` is one line: `file: key: what is wrong`."""

    def __init__(self, source: str | None, key: str | None, detail: str) -> None:
        self.source = source
        self.key = key
        self.detail = detail
        where = ": ".join(part for part in (source, key) if part)
        super().__init__(f"{where}: {detail}" if where else detail)
