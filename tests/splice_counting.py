"""A renderer that counts the splice's neutral renderings: the tests that show a proof needs none of them."""

from __future__ import annotations

from nemo_gym_tok.splice import HFChatRenderer


class CountingRenderer(HFChatRenderer):
    """Counts neutral renderings of assistant turns: placeholders for the model's text, everyone else's text real
    (the placement rendering has placeholders for every text, the server's own rendering none)."""

    neutral_renders = 0

    def render(self, messages, **kwargs):
        contents = [str(m.get("content")) for m in messages]
        if any("ngtbody" in c for c in contents) and not any("ngtmsg" in c for c in contents):
            self.neutral_renders += 1
        return super().render(messages, **kwargs)
