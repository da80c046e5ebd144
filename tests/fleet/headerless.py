"""A harness that sends no session header (as NeMo Gym's vllm_model, TRL and a bare OpenAI-SDK loop do): multi-turn
conversations through the gym's adapter with the OpenAI SDK, each assistant turn sent back with its token bundle."""

from __future__ import annotations

from typing import Any

from openai import OpenAI

BUNDLE = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def converse_without_session_header(
    adapter_url: str, model: str, *, conversations: int, turns: int
) -> list[list[dict[str, Any]]]:
    """Per conversation, each turn's answer message (its bundle and the replica that served it)."""
    client = OpenAI(base_url=f"{adapter_url}/v1", api_key="unused", max_retries=0, timeout=300)
    answers = []
    for index in range(conversations):
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Game {index}: guess my number, 1 to 100."}]
        replies = []
        for _ in range(turns):
            completion = client.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=index)
            reply = completion.choices[0].message.model_dump()
            replies.append(reply)
            assistant = {"role": "assistant", "content": reply["content"] or ""}
            assistant.update({key: reply[key] for key in BUNDLE})
            messages += [assistant, {"role": "user", "content": "Higher."}]
        answers.append(replies)
    return answers
