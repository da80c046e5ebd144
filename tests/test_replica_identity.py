"""The hook's name and fingerprint for its bundles (nemo_gym_tok.vllm.replica_identity), without vLLM: the name from
the command line, and a fingerprint equal to the one the adapter reads from the model directory."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import AutoTokenizer

from nemo_gym_tok.contract.provenance import model_fingerprint
from nemo_gym_tok.vllm import replica_identity


@pytest.mark.parametrize(
    ("argv", "environ", "name"),
    [
        (["vllm", "--host", "127.0.0.1", "--port", "8011"], {}, "http://127.0.0.1:8011"),
        (["vllm", "--host=10.0.0.7", "--port=9000"], {}, "http://10.0.0.7:9000"),
        (["vllm", "--host", "127.0.0.1", "--port", "8011"], {"NEMO_GYM_TOK_REPLICA": "gpu-node-3"}, "gpu-node-3"),
    ],
)
def test_a_replica_is_named_by_its_address_or_its_operator(argv: list[str], environ: dict[str, str], name: str) -> None:
    assert replica_identity.replica_name(argv, environ) == name


def test_a_wildcard_or_missing_host_is_the_machines_name_and_the_port_vllms_default() -> None:
    import socket

    assert replica_identity.replica_name(["vllm", "--host", "0.0.0.0"], {}) == f"http://{socket.gethostname()}:8000"
    assert replica_identity.replica_name(["vllm"], {}) == f"http://{socket.gethostname()}:8000"


def renderer_of(model_dir: Path, chat_template: str | None = None) -> Any:
    """vLLM's OnlineRenderer as replica_identity reads it: the tokenizer, the --chat-template, the model config."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return SimpleNamespace(
        renderer=SimpleNamespace(get_tokenizer=lambda: tokenizer),
        chat_template=chat_template,
        model_config=SimpleNamespace(tokenizer=str(model_dir), tokenizer_revision=None),
    )


def test_the_hooks_fingerprint_is_the_adapters_and_a_template_override_changes_it(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replica_identity, "_identity", {})
    assert replica_identity.served_by_fields() == {}  # before start-up: nothing said
    monkeypatch.setenv("NEMO_GYM_TOK_REPLICA", "replica-a")
    replica_identity.learn(renderer_of(tiny_model_dir))
    fields = replica_identity.served_by_fields()
    assert fields == {"replica": "replica-a", "model_fingerprint": model_fingerprint(tiny_model_dir)}
    fields["model_fingerprint"]["sha256"] = "changed"  # each bundle gets its own copy
    assert replica_identity.served_by_fields()["model_fingerprint"] == model_fingerprint(tiny_model_dir)

    replica_identity.learn(renderer_of(tiny_model_dir, chat_template="{{ messages }}"))
    other = replica_identity.served_by_fields()["model_fingerprint"]
    expected = model_fingerprint(tiny_model_dir)
    assert other["tokenizer_sha256"] == expected["tokenizer_sha256"]
    assert other["chat_template_sha256"] != expected["chat_template_sha256"] and other["sha256"] != expected["sha256"]


def test_the_servers_default_template_kwargs_are_in_the_hooks_fingerprint(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replica_identity, "_identity", {})
    online = renderer_of(tiny_model_dir)
    online.default_chat_template_kwargs = {"enable_thinking": False}  # `--default-chat-template-kwargs`
    replica_identity.learn(online)
    served = replica_identity.served_by_fields()["model_fingerprint"]
    assert served == model_fingerprint(tiny_model_dir, {"enable_thinking": False})
    assert served["sha256"] != model_fingerprint(tiny_model_dir)["sha256"]


def test_a_tokenizer_without_any_readable_tokenizer_file_gives_no_fingerprint(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replica_identity, "_identity", {})
    online = renderer_of(tiny_model_dir)
    online.model_config.tokenizer = str(tmp_path / "not-a-model")
    replica_identity.learn(online)
    assert set(replica_identity.served_by_fields()) == {"replica"}  # unknown, never a guess
