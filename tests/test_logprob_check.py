"""`ngt check --logprobs`: recorded log probs against a transformers recompute, and the naive re-rendering's drift."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_tok.cli.main import main
from nemo_gym_tok.contract.conversion import chat_message_to_items
from nemo_gym_tok.contract.provenance import (
    TOKENIZER_FILES,
    effective_sampling,
    generation_defaults,
    model_fingerprint,
)
from nemo_gym_tok.records.logprob_check import check_records, naive_sequence
from nemo_gym_tok.servers.inprocess import serve_in_thread
from nemo_gym_tok.vllm_server import VLLMServer
from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig
from responses_api_models.vllm_model.token_capture import attach_provenance
from tests.conversations import MOVE_TOOL


def _items(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in chat_message_to_items(message)]


def _history(message: dict[str, Any]) -> dict[str, Any]:
    kept = {
        key: message[key]
        for key in ("role", "content", "tool_calls", "prompt_token_ids", "generation_token_ids", "generation_log_probs")
        if message.get(key) is not None
    }
    kept["content"] = kept.get("content") or ""
    return kept


def test_recompute_on_a_real_vllm_record_matches_free_turns_and_lists_constrained_ones_apart(
    vllm_server: VLLMServer,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A two-call episode through the adapter on the real vLLM: a tool call forced by tool_choice "required", then a
    # free turn; recorded as the simple agent would (the output items of both calls, schema version 1).
    adapter = VLLMModel(
        "policy_model",
        VLLMModelConfig(
            base_url=vllm_server.base_url, model=vllm_server.served_model_name, return_token_id_information=True
        ),
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Where next?"}]
    common = {"model": "policy", "tools": [MOVE_TOOL], "seed": 3, "temperature": 1.0, "max_tokens": 40}
    with serve_in_thread(adapter.build_app()) as url, httpx.Client(base_url=url, timeout=300) as http:
        answer = http.post(
            "/v1/chat/completions",
            json={**common, "messages": messages, "tool_choice": "required", "parallel_tool_calls": False},
        )
        assert answer.status_code == 200, answer.text
        constrained = answer.json()["choices"][0]["message"]
        results = [
            {"role": "tool", "tool_call_id": call["id"], "content": "moved"}
            for call in constrained.get("tool_calls") or []
        ]
        follow_up = {"role": "user", "content": "And now?"}
        messages += [_history(constrained), *results, follow_up]
        answer = http.post("/v1/chat/completions", json={**common, "messages": messages})
        assert answer.status_code == 200, answer.text
        free = answer.json()["choices"][0]["message"]
    assert constrained["constrained_by"] == ["tool_choice:required"] and free["constrained_by"] == []
    # Each call says how it was sampled and which tokenizer served it.
    assert free["sampling"] == {
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "max_tokens": 40,
        "seed": 3,
        "logprobs_mode": "raw_logprobs",
        "generation_config": True,
    }
    assert free["model_fingerprint"] == constrained["model_fingerprint"]
    local = model_fingerprint(tiny_model_dir)  # the server's default template kwargs (cohere_format) are its own
    assert [free["model_fingerprint"][key] for key in ("tokenizer_sha256", "chat_template_sha256")] == [
        local["tokenizer_sha256"],
        local["chat_template_sha256"],
    ]
    output = [
        *_items(constrained),
        *[{"type": "function_call_output", "call_id": r["tool_call_id"], "output": r["content"]} for r in results],
        {"type": "message", "role": "user", "content": "And now?"},
        *_items(free),
    ]
    record = {
        "responses_create_params": {"input": "Where next?", "tools": [{"type": "function", **MOVE_TOOL["function"]}]},
        "response": {"output": output},
        "reward": 0.0,
    }
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps(record) + "\n")

    assert all("sampling" in item and "model_fingerprint" in item for item in output if "generation_token_ids" in item)
    status = main(["check", "--logprobs", str(tiny_model_dir), "--naive", str(path)])
    out = capsys.readouterr().out
    assert "no model_fingerprint" not in out  # the fingerprint was checked, and matched
    assert status == 0, out
    free_line = next(line for line in out.splitlines() if line.startswith("  free turns 1 "))
    mean = float(free_line.split("mean |diff| ")[1].split(" nats")[0])
    assert mean < 0.01, out
    # The constrained turn is reported apart: its recorded log probs are of the grammar-masked distribution.
    constrained_section = out.split("constrained turns (", 1)[1]
    assert "rollouts.jsonl:1 turn 0: tool_choice:required" in constrained_section
    assert "turn 1:" not in constrained_section
    assert "  constrained turns 1 " in out
    assert "naive re-rendering" in out


def _tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _synthetic_record(tokenizer: Any, generation: list[int]) -> dict[str, Any]:
    # One free turn whose sampled ids spell "hello world" then <|im_end|>; the naive path only sees the text.
    user = {"role": "user", "content": "hi"}
    prompt = list(tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=True))
    if not isinstance(prompt[0], int):  # newer transformers return a BatchEncoding
        prompt = list(tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=True)["input_ids"])
    text = tokenizer.decode(generation[:-1])
    item = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [-1.0] * len(generation),
        "constrained_by": [],
        "generation_forced_mask": [0] * len(generation),
    }
    return {"responses_create_params": {"input": [user]}, "response": {"output": [item]}}


def _position_score(token_ids: Sequence[int]) -> list[float]:
    # Depends on id and position, so a re-tokenized turn's sum moves; no model needed.
    return [0.0, *(-(token % 13) / 10 - index / 1000 for index, token in enumerate(token_ids[1:], 1))]


def test_naive_contrast_counts_the_ids_a_re_tokenization_replaces(tiny_model_dir: Path) -> None:
    tokenizer = _tokenizer(tiny_model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    canonical = [*tokenizer("hello world", add_special_tokens=False)["input_ids"], end]
    # The model spelled "hello" as "hel" + "lo": the text is the same, the ids are not.
    drifted = [
        *tokenizer("hel", add_special_tokens=False)["input_ids"],
        *tokenizer("lo", add_special_tokens=False)["input_ids"],
        *tokenizer(" world", add_special_tokens=False)["input_ids"],
        end,
    ]
    assert tokenizer.decode(drifted) == tokenizer.decode(canonical) and drifted != canonical

    same = check_records(
        [("same", _synthetic_record(tokenizer, canonical))],
        _position_score,
        lambda record: naive_sequence(record, tokenizer),
    )
    assert [(turn.naive_changed, turn.naive_sum) for turn in same.turns] == [(0, same.turns[0].recomputed_sum)]

    report = check_records(
        [("drift", _synthetic_record(tokenizer, drifted))],
        _position_score,
        lambda record: naive_sequence(record, tokenizer),
    )
    (turn,) = report.turns
    # Re-tokenized, "hello world<|im_end|>" is 3 ids where 4 were sampled: from "hel" on every position differs.
    assert turn.naive_changed == len(drifted)
    assert turn.naive_sum is not None and abs(turn.naive_sum - turn.recomputed_sum) > 0.1
    assert turn.kind == "free"
    assert f"{len(drifted)} of {len(drifted)} generated positions carry another id" in report.format()


def test_naive_needs_logprobs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text("")
    assert main(["check", "--naive", str(path)]) == 2
    assert "--naive needs --logprobs" in capsys.readouterr().err


def test_effective_sampling_takes_request_then_generation_config_then_vllm_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 512, "do_sample": True})
    )
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 512}
    sampling = effective_sampling({"temperature": 1.0, "seed": 5, "max_completion_tokens": 64}, defaults)
    assert sampling["temperature"] == 1.0 and sampling["top_p"] == 0.95 and sampling["top_k"] == 20
    assert sampling["min_p"] == 0.0 and sampling["repetition_penalty"] == 1.0
    assert sampling["max_tokens"] == 64 and sampling["seed"] == 5
    assert sampling["logprobs_mode"] == "raw_logprobs" and sampling["generation_config"] is True
    unknown = effective_sampling({}, None)
    assert unknown["temperature"] == 1.0 and unknown["max_tokens"] is None and unknown["generation_config"] is False


def test_attach_provenance_marks_bundled_messages_only() -> None:
    result = {"choices": [{"message": {"generation_token_ids": [1]}}, {"message": {"content": "x"}}]}
    attach_provenance(result, {"top_k": 5}, {}, {"sha256": "f"})
    bundled, plain = (choice["message"] for choice in result["choices"])
    assert bundled["sampling"]["top_k"] == 5 and bundled["model_fingerprint"] == {"sha256": "f"}
    assert "sampling" not in plain and "model_fingerprint" not in plain


def test_fingerprint_follows_the_chat_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    for name in TOKENIZER_FILES:
        if (tiny_model_dir / name).is_file():
            (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert model_fingerprint(tmp_path) == model_fingerprint(tiny_model_dir)
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    changed = model_fingerprint(tmp_path)
    assert changed["tokenizer_sha256"] == model_fingerprint(tiny_model_dir)["tokenizer_sha256"]
    assert changed["sha256"] != model_fingerprint(tiny_model_dir)["sha256"]


def test_logprobs_check_refuses_a_model_whose_fingerprint_differs(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tokenizer = _tokenizer(tiny_model_dir)
    record = _synthetic_record(tokenizer, [*tokenizer("hello", add_special_tokens=False)["input_ids"]])
    item = record["response"]["output"][0]
    item["model_fingerprint"] = {**model_fingerprint(tiny_model_dir), "tokenizer_sha256": "0" * 64}
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps(record) + "\n")
    assert main(["check", "--logprobs", str(tiny_model_dir), str(path)]) == 2
    captured = capsys.readouterr()
    assert "is not the model that served these rollouts: the tokenizer's files differ" in captured.err
    assert "recorded 0000000000000000/" in captured.err
    assert "rollout" not in captured.out  # refused before any recompute
