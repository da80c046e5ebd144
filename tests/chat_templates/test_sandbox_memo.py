"""Every official chat template renders every request of its sweep episodes to the same text, or raises the same
error, with the Jinja sandbox's shortcuts (nemo_gym_tok.common.jinja_sandbox) as without."""

from __future__ import annotations

from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nemo_gym_tok.common.jinja_sandbox import memoize_attribute_checks
from nemo_gym_tok.splice import HFChatRenderer
from nemo_gym_tok.testing.chat_templates import entry
from nemo_gym_tok.testing.chat_templates.sweep import sweep_template
from tests.chat_templates.test_sweep import OFFICIAL

SHORTCUTS = ("is_safe_attribute", "getattr")


def _outcome(render: Any) -> tuple[str, str]:
    try:
        return "text", render()
    except Exception as exc:  # noqa: BLE001 - a template's own refusal is an outcome to compare too
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("name", [name for names in OFFICIAL.values() for name in names], ids=lambda name: name[:40])
def test_official_template_renders_alike_with_the_memo(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert memoize_attribute_checks()
    shortcuts = {name: getattr(ImmutableSandboxedEnvironment, name) for name in SHORTCUTS}
    render = HFChatRenderer.render
    compared: list[str] = []

    def render_both(self: HFChatRenderer, messages: Any, **flags: Any) -> str:
        for name, method in shortcuts.items():
            monkeypatch.setattr(ImmutableSandboxedEnvironment, name, method.__wrapped__)
        expected = _outcome(lambda: render(self, messages, **flags))
        for name, method in shortcuts.items():
            monkeypatch.setattr(ImmutableSandboxedEnvironment, name, method)
        assert _outcome(lambda: render(self, messages, **flags)) == expected
        compared.append(expected[0])
        return render(self, messages, **flags)

    monkeypatch.setattr(HFChatRenderer, "render", render_both)
    sweep_template(entry(name), episodes_per_shape=1)
    assert compared.count("text") >= 10, compared
