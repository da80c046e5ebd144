"""Run inside .venv-clients (verifiers 0.4, renderers 0.1.12): two turns through renderers' generate client.

What verifiers 0.4's TrainClient does per turn: render the prompt client-side (renderers), bridge the next turn onto the
previous turn's prompt + completion ids (`bridge_to_next_turn`), POST the ids to vLLM's /inference/v1/generate. Prints
one JSON line with the ids, for tests/test_clients.py to check against the hooked server.
Usage: python verifiers_turns.py BASE_URL MODEL TOKENIZER_DIR RENDERER
"""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
from openai import AsyncOpenAI
from renderers import create_renderer
from renderers.client import MalformedGenerateResponseError, generate
from renderers.configs import config_from_name
from transformers import PreTrainedTokenizerFast


async def main(base_url: str, model: str, tokenizer_dir: str, renderer_name: str) -> dict:
    renderer = create_renderer(PreTrainedTokenizerFast.from_pretrained(tokenizer_dir), config_from_name(renderer_name))
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
    first = [{"role": "user", "content": "Where next?"}]
    follow = [{"role": "user", "content": "And then?"}]
    sampling = {"max_tokens": 12, "temperature": 1.0, "seed": 7, "min_tokens": 6, "logit_bias": {"151645": 100}}
    out: dict = {}
    try:  # renderers' own generate client, as verifiers' TrainClient calls it
        await generate(client=client, renderer=renderer, messages=first, model=model, sampling_params=sampling)
        out["client_error"] = None
    except MalformedGenerateResponseError as exc:
        out["client_error"] = str(exc)
    # The same turn by hand: the renderer's ids, POSTed as the client does (its body, without its response parser).
    prompt = list(renderer.render_ids(first, add_generation_prompt=True))
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        sent = {
            "model": model,
            "token_ids": prompt,
            "sampling_params": {
                **sampling,
                "logprobs": 1,
                "stop_token_ids": renderer.get_stop_token_ids(),
                "skip_special_tokens": False,
            },
        }
        answer = (await http.post("/inference/v1/generate", json=sent)).json()
        choice = answer["choices"][0]
        completion = list(choice["token_ids"])
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        bridged = renderer.bridge_to_next_turn(prompt, completion, follow)
        parsed = renderer.parse_response(completion, prompt_ids=prompt)
        # The same conversation as a bundle, through the hook (/tokenize renders and splices like a chat completion).
        assistant = {
            "role": "assistant",
            "content": parsed.content or "",
            "prompt_token_ids": prompt,
            "generation_token_ids": completion,
            "generation_log_probs": logprobs,
        }
        template = await http.post("/tokenize", json={"model": model, "messages": first})
        hooked = await http.post("/tokenize", json={"model": model, "messages": [*first, assistant, *follow]})
        second = None
        if bridged is not None:
            sent = {"model": model, "token_ids": list(bridged.token_ids), "sampling_params": {"max_tokens": 2}}
            second = (await http.post("/inference/v1/generate", json=sent)).json()["usage"]["prompt_tokens"]
    out.update(
        prompt=prompt,
        server_prompt=template.json()["tokens"],
        completion=completion,
        finish_reason=choice["finish_reason"],
        bridged=None if bridged is None else list(bridged.token_ids),
        second_prompt_tokens=second,
        hook_status=hooked.status_code,
        hook=hooked.json().get("tokens") if hooked.status_code == 200 else hooked.text,
    )
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:5]))))
