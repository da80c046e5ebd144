"""Planted faults in the splice (a wrong id, a crash in 1 of N calls): the tests that show the oracles fail on them."""

from __future__ import annotations

import dataclasses

import pytest

from nemo_gym_tok.splice import SplicedPrompt, SpliceResult


class PlantedSplice:
    """Makes 1 splice in `every` go wrong where splice_prefix finishes it (`SplicedPrompt.result`).

    `kind` "wrong": the splice returns its prompt with one id after the kept prefix changed (the template's part, so
    the prefix check alone cannot see it). `kind` "crash": the splice raises an IndexError from inside the splice, as a
    bug in our code would. `planted` counts the splices that went wrong, so a test can show the plant fired.
    The plant goes through the splice's public surface: the classes it exports, never its private modules.
    """

    def __init__(self, kind: str, every: int) -> None:
        assert kind in ("wrong", "crash")
        self.kind, self.every = kind, every
        self.calls = self.planted = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> PlantedSplice:
        real = SplicedPrompt.result

        def planted(spliced: SplicedPrompt) -> SpliceResult:
            self.calls += 1
            if self.calls % self.every:
                return real(spliced)
            self.planted += 1
            if self.kind == "crash":
                raise IndexError("list index out of range (planted in the splice)")
            result = real(spliced)
            ids = list(result.prompt_token_ids)
            at = min(len(ids) - 1, result.kept_prefix_length + (len(ids) - result.kept_prefix_length) // 2)
            ids[at] = next(i for i in ids if i != ids[at])  # another id the prompt uses: one the vocabulary has
            return dataclasses.replace(result, prompt_token_ids=ids)

        monkeypatch.setattr(SplicedPrompt, "result", planted)
        return self
