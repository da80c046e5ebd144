"""Why `renderers`' bridge may differ from the splice's ids: one rule per choice the template never makes."""

from __future__ import annotations

from collections.abc import Sequence

from nemo_gym_tok.splice import HFChatRenderer


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many ids the two sequences share from the start."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def classify(renderer: HFChatRenderer, previous: list[int], ours: list[int], theirs: list[int], *, ended: bool) -> str:
    """The rule that explains why renderers' bridge differs from the splice's ids, or "" if none does.

    Both keep the previous prompt and completion ids; the rules name the one place they may part, each a choice of
    renderers' that the template's own rendering does not make (the splice's ids end as the template's do, which
    the project's oracle checks on every turn):
    - `closes a cut turn`: the turn was cut by max_tokens, and renderers appends its own close right after the
      model's ids (`</think>` for reasoning left open, GLM's `<|endoftext|>`), then continues as the splice does
      (which may first write the whitespace the template puts before its closing: Nemotron 3 after a tool call);
    - `keeps the model's end token`: the turn ended on an end token that is not the template's closer of an assistant
      turn (Qwen's `<|endoftext|>`, Llama's `<|eom_id|>`); the splice gives it way to the template's closer, renderers
      keeps it, and the rest is the same.
    """
    n = len(previous)
    if theirs[:n] != previous:
        return ""
    if not ended and ours[:n] == previous:
        # The splice's ids may open with the whitespace the template writes before its closing (the junction, which
        # the project's oracle checks); renderers writes its close there instead.
        kept = [j for j in range(4) if j == 0 or renderer.decode(ours[n : n + j]).isspace()]
        for m in (1, 2, 3):
            inserted = theirs[n : n + m]
            if not all(renderer.decode([i]) in renderer.added_tokens for i in inserted):
                continue
            for j in kept:
                if theirs[n + m :] == ours[n + j :]:
                    instead = f", where the template writes {renderer.decode(ours[n : n + j])!r}" if j else ""
                    return (
                        f"cut by max_tokens: renderers closes the turn with {renderer.decode(inserted)!r}, which "
                        f"the template does not render there{instead}"
                    )
    if ended and ours[: n - 1] == previous[:-1] and len(ours) >= n:
        end, closer = previous[-1], ours[n - 1]
        if closer != end and theirs[: n - 1] + [closer] + theirs[n:] == ours:
            return (
                f"ended on {renderer.decode([end])!r}: the splice writes the template's closer "
                f"{renderer.decode([closer])!r} in its place, renderers keeps the model's token"
            )
    return ""
