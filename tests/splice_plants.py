"""Planted faults in the splice (a wrong id, a crash in 1 of N calls): the tests that show the oracles fail on them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from nemo_gym_tok.splice import SplicedPrompt, SpliceResult


class PlantedSplice:
    """Makes 1 splice in `every` go wrong.

    `kind` "wrong": where the splice finishes (`SplicedPrompt.result`), it returns its prompt with one id after the
    kept prefix changed (the template's part, so the prefix check alone cannot see it). `kind` "crash": the splice
    raises an IndexError from inside `splice_prompt` (where it builds its `SplicedPrompt`), as a bug in our code
    would. `planted` counts the splices that went wrong, so a test can show the plant fired.
    The plant goes through the splice's public surface: the classes it exports, never its private modules.
    """

    def __init__(self, kind: str, every: int) -> None:
        assert kind in ("wrong", "crash")
        self.kind, self.every = kind, every
        self.calls = self.planted = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> PlantedSplice:
        if self.kind == "crash":
            real_init = SplicedPrompt.__init__

            def planted_crash(spliced: SplicedPrompt, *args: Any, **kwargs: Any) -> None:
                if self._fires():
                    raise IndexError("list index out of range (planted in the splice)")
                real_init(spliced, *args, **kwargs)

            monkeypatch.setattr(SplicedPrompt, "__init__", planted_crash)
            return self
        real = SplicedPrompt.result

        def planted(spliced: SplicedPrompt) -> SpliceResult:
            if not self._fires():
                return real(spliced)
            result = real(spliced)
            ids = list(result.prompt_token_ids)
            at = min(len(ids) - 1, result.kept_prefix_length + (len(ids) - result.kept_prefix_length) // 2)
            ids[at] = next(i for i in ids if i != ids[at])  # another id the prompt uses: one the vocabulary has
            return dataclasses.replace(result, prompt_token_ids=ids)

        monkeypatch.setattr(SplicedPrompt, "result", planted)
        return self

    def _fires(self) -> bool:
        """Counts a call; whether the plant goes wrong on it (1 in `every`)."""
        self.calls += 1
        if self.calls % self.every:
            return False
        self.planted += 1
        return True
