"""vLLM general plugin entry point: installs the prefix-splice hook when NEMO_GYM_TOK_PREFIX_SPLICE=1, else nothing."""

from __future__ import annotations

import os


def register() -> None:
    """Called by vLLM in each of its processes; inert unless the hook is switched on."""
    if os.environ.get("NEMO_GYM_TOK_PREFIX_SPLICE") != "1":
        return
    # Installed in every vLLM process (cheap, idempotent); only the API server ever calls the wrapped methods.
    from nemo_gym_tok.vllm.hook import install

    install()
