"""The adapter's Python work for a continued /v1/responses call: the kept chat messages against converting the whole
history, in this process (no server, no HTTP): expand, chat form and validation, the parts the kept path changes.

    .venv/bin/python bench/chain_cpu.py

A probe beside `make bench`, not a figure of it: one conversation per size built through ResponseChain with bundles of
the size's ids (random), then its next call (one new user item) timed both ways, 30 times each, medians not taken
(the mean of 30). Run on a quiet machine; the ratio between the two lines is what it is for.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from responses_api_models.vllm_model.calls import ChatCall
from responses_api_models.vllm_model.chat_form import chat_form, kept_chat_messages
from responses_api_models.vllm_model.response_chain import ResponseChain


def timed(name: str, work: Callable[[], Any], repeats: int = 30) -> float:
    work()
    started = time.perf_counter()
    for _ in range(repeats):
        work()
    ms = (time.perf_counter() - started) / repeats * 1000
    print(f"{name:55s} {ms:7.2f} ms")
    return ms


def main() -> None:
    for size, calls in ((1000, 5), (7000, 20), (32000, 40)):
        rng = random.Random(0)
        ids = [rng.randrange(100, 150000) for _ in range(size)]
        chain = ResponseChain(10**8)
        previous = None
        for turn in range(calls):
            if previous is None:
                raw: dict[str, Any] = {"input": [{"role": "user", "content": "Guess."}], "instructions": "Be brief."}
            else:
                raw = {"previous_response_id": previous, "input": [{"role": "user", "content": "Higher. " * 30}]}
            call = chain.expand(raw)
            form = chat_form(call)
            chat = ChatCall.validated(form.body, checked=form.checked)
            end = size * (turn + 1) // calls
            output = [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "42 " * 50}],
                    "prompt_token_ids": ids[: end - 50],
                    "generation_token_ids": ids[end - 50 : end],
                    "generation_log_probs": [-0.5] * 50,
                }
            ]
            kept = kept_chat_messages(call, chat.body["messages"], output)
            previous = chain.answered({"id": f"resp_{turn}", "output": output}, call, kept)["id"]
        following = {"previous_response_id": previous, "input": [{"role": "user", "content": "Higher."}]}

        def continued(kept_chat: bool) -> Callable[[], ChatCall]:
            def work() -> ChatCall:
                call = chain.expand(dict(following))
                if not kept_chat:
                    call.kept_chat = None
                form = chat_form(call)
                return ChatCall.validated(form.body, checked=form.checked)

            return work

        print(f"--- {size} ids in the kept bundle, {calls} calls")
        fast = timed("continued call, kept chat messages", continued(True))
        whole = timed("continued call, the whole history converted", continued(False))
        print(f"whole / kept: {whole / fast:.1f}")


if __name__ == "__main__":
    main()
