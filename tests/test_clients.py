"""The real clients of the hooked server's routes: TRL 1.16's VLLMClient (.venv) and verifiers 0.4's renderers client
(.venv-clients, `make clients-venv`: verifiers pins openai<3 and renderers installs openai-harmony). docs/clients.md."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from nemo_gym_tok.vllm_server import VLLMServer

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"


@pytest.fixture(scope="module")
def trl_client(vllm_server: VLLMServer):
    from trl.generation.vllm_client import VLLMClient

    return VLLMClient(base_url=vllm_server.base_url, connection_timeout=60)


def test_trl_generate_sends_ids_on_completions(vllm_server: VLLMServer, trl_client) -> None:
    """VLLMClient.generate with token ids: /v1/completions generates from exactly those ids (no template, no hook)."""
    ids = [151644, 872, 198, 9064, 1790, 30, 151645, 198, 151644, 77091, 198]
    out = trl_client.generate([ids], max_tokens=4, generation_kwargs={"seed": 1})
    assert out["prompt_ids"] == [ids]
    assert 0 < len(out["completion_ids"][0]) <= 4


def test_trl_chat_with_a_bundle_is_spliced(vllm_server: VLLMServer, trl_client) -> None:
    """VLLMClient.chat sends the messages as they are, so an assistant message carrying its bundle reaches the hook:
    the next prompt starts with the model's own ids. A bundle from another conversation is TRL's exception (400)."""
    first = [{"role": "user", "content": "Where next?"}]
    turn = trl_client.chat([first], max_tokens=12, generation_kwargs={"seed": 7})
    prompt, completion = turn["prompt_ids"][0], turn["completion_ids"][0]
    logprobs = [step[0] for step in turn["logprobs"][0]]
    assistant = {
        "role": "assistant",
        "content": "",
        "prompt_token_ids": prompt,
        "generation_token_ids": completion,
        "generation_log_probs": logprobs,
    }
    # The content as the model wrote it (TRL returns ids only): the server's /detokenize of the completion.
    import httpx

    assistant["content"] = httpx.post(
        f"{vllm_server.base_url}/detokenize",
        json={"model": vllm_server.served_model_name, "tokens": completion},
        timeout=60,
    ).json()["prompt"]
    second = trl_client.chat([[*first, assistant, {"role": "user", "content": "And then?"}]], max_tokens=2)
    assert second["prompt_ids"][0][: len(prompt) + len(completion)] == prompt + completion
    stale = {**assistant, "prompt_token_ids": [*prompt[:-1], 11]}
    with pytest.raises(Exception, match="400"):
        trl_client.chat([[*first, stale, {"role": "user", "content": "And then?"}]], max_tokens=2)


def test_verifiers_renderers_client(vllm_server: VLLMServer, tiny_model_dir: Path) -> None:
    """verifiers 0.4's train client path (renderers 0.1.12) against vLLM 0.32's /inference/v1/generate."""
    assert CLIENTS_PYTHON.exists(), "run `make clients-venv` (verifiers 0.4 in .venv-clients)"
    script = ROOT / "tests" / "clients" / "verifiers_turns.py"
    completed = subprocess.run(
        [
            str(CLIENTS_PYTHON),
            str(script),
            vllm_server.base_url,
            vllm_server.served_model_name,
            str(tiny_model_dir),
            "qwen3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = json.loads(completed.stdout.strip().splitlines()[-1])
    # renderers' response parser wants vLLM 0.30/0.31's logprob shape (`"token": "token_id:N"`); 0.32 answers
    # `"token_id": N` in its default output_mode "tokens", so the client refuses every answer (docs/clients.md).
    assert out["client_error"] is not None and "token_id:" in out["client_error"]
    # Its rendering of the first turn is the server's; the hook splices the bundle of that turn.
    assert out["prompt"] == out["server_prompt"]
    assert out["hook_status"] == 200
    assert out["hook"][: len(out["prompt"]) + len(out["completion"])] == out["prompt"] + out["completion"]
    # Qwen3Renderer re-renders (no bridge) when a new user message follows: its thinking-retention policy.
    assert out["bridged"] is None
