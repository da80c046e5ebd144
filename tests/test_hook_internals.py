"""The hook's grip on vLLM internals: a vLLM upgrade that moves them fails here, naming what moved."""

from __future__ import annotations

import pytest

from nemo_gym_tok.vllm import hook


def test_every_patched_vllm_symbol_is_where_the_hook_expects_it() -> None:
    missing = hook.check_internals()
    assert missing == [], f"vLLM moved what the prefix-splice hook wraps: {missing}"


@pytest.fixture
def unpatched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a test install the hook in this process; monkeypatch restores the original methods afterwards."""
    for module_name, class_name, method in hook.PATCHED_METHODS:
        owner = hook._lookup(module_name, class_name)
        monkeypatch.setattr(owner, method, getattr(owner, method))


@pytest.mark.parametrize("module_name, class_name, method", hook.PATCHED_METHODS)
def test_a_moved_method_is_named(unpatched, monkeypatch: pytest.MonkeyPatch, module_name, class_name, method) -> None:
    monkeypatch.delattr(hook._lookup(module_name, class_name), method)
    assert hook.check_internals() == [f"{module_name}.{class_name}.{method}"]
    with pytest.raises(hook.VLLMInternalsChanged, match=f"missing {module_name}.{class_name}.{method}"):
        hook.install()


def test_a_moved_symbol_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.exceptions

    monkeypatch.delattr(vllm.exceptions, "VLLMValidationError")
    assert hook.check_internals() == ["vllm.exceptions.VLLMValidationError"]


def test_untested_vllm_version_is_refused_unless_allowed(unpatched, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    monkeypatch.delenv(hook.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(hook.VLLMInternalsChanged, match="tested on vLLM 0.32.x, found 0.40.1"):
        hook.install()
    monkeypatch.setenv(hook.ALLOW_UNTESTED_ENV, "1")
    hook.install()
    assert hook.is_installed()


def test_install_is_idempotent(unpatched) -> None:
    from vllm.renderers.online_renderer import OnlineRenderer

    original = OnlineRenderer.preprocess_chat
    hook.install()
    first = OnlineRenderer.preprocess_chat
    hook.install()
    assert OnlineRenderer.preprocess_chat is first
    assert getattr(first, "__nemo_gym_tok_original__") is original


def test_plugin_is_inert_unless_enabled(unpatched, monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo_gym_tok.vllm.plugin import register

    monkeypatch.delenv(hook.ENABLE_ENV, raising=False)
    register()
    assert not hook.is_installed()
    monkeypatch.setenv(hook.ENABLE_ENV, "1")
    register()
    assert hook.is_installed()
