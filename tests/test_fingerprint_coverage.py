"""What a model fingerprint covers (nemo_gym_tok.contract.provenance): every change that alters the rendered prompt or
its ids changes it, and says which part changed; the hook and a model directory compute the same one."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from nemo_gym_tok.contract.provenance import fingerprint_difference, model_fingerprint, tokenizer_files


def edit_json(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        path = directory / name
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data, indent=2))

    return apply


def rename_first_added_token(data: dict) -> None:
    data["added_tokens"][0]["content"] = "<|renamed|>"


def flip_first_added_token(data: dict) -> None:
    data["added_tokens"][0]["special"] = not data["added_tokens"][0]["special"]


def add_file(name: str, text: str) -> Callable[[Path], None]:
    return lambda directory: (directory / name).write_text(text)


CHANGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "an added token renamed in tokenizer.json": (edit_json("tokenizer.json", rename_first_added_token), "tokenizer"),
    "another eos token": (
        edit_json("tokenizer_config.json", lambda d: d.update(eos_token="<|endoftext|>")),
        "tokenizer",
    ),
    "a special token no longer special": (edit_json("tokenizer.json", flip_first_added_token), "tokenizer"),
    "a special_tokens_map.json added": (
        add_file("special_tokens_map.json", '{"bos_token": "<|im_start|>"}'),
        "tokenizer",
    ),
    "merges.txt added beside tokenizer.json": (add_file("merges.txt", "#version: 0.2\nh e\n"), "tokenizer"),
    "a chat_template.jinja overriding the config's": (add_file("chat_template.jinja", "{{ messages }}"), "template"),
}


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model_dir / name, copy / name)
    return copy


@pytest.mark.parametrize("change", list(CHANGES))
def test_each_change_that_alters_rendering_or_ids_changes_the_fingerprint_and_is_named(
    change: str, model_copy: Path
) -> None:
    before = model_fingerprint(model_copy)
    apply, part = CHANGES[change]
    apply(model_copy)
    after = model_fingerprint(model_copy)
    assert after["sha256"] != before["sha256"]
    named = fingerprint_difference(before, after)
    assert named == {"tokenizer": "the tokenizer's files", "template": "the chat template"}[part]


def test_the_servers_default_template_kwargs_are_part_of_it(model_copy: Path) -> None:
    plain = model_fingerprint(model_copy)
    thinking_off = model_fingerprint(model_copy, {"enable_thinking": False})
    assert thinking_off["sha256"] != plain["sha256"]
    assert fingerprint_difference(plain, thinking_off) == "the server's default chat template kwargs"
    # The same kwargs in another order, and none given against none set, are the same fingerprint.
    both = {"enable_thinking": False, "cohere_format": "x"}
    assert model_fingerprint(model_copy, both) == model_fingerprint(model_copy, dict(reversed(both.items())))
    assert model_fingerprint(model_copy, {}) == plain


def test_a_directory_without_any_tokenizer_file_cannot_be_fingerprinted(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert tokenizer_files(tmp_path) == {}
    with pytest.raises(OSError, match="holds none of the tokenizer files"):
        model_fingerprint(tmp_path)


def test_unrelated_files_do_not_change_it(model_copy: Path) -> None:
    before = model_fingerprint(model_copy)
    (model_copy / "README.md").write_text("notes")
    (model_copy / "config.json").write_text('{"changed": true}')  # the weights' shape is the probe's business
    assert model_fingerprint(model_copy) == before
