"""vLLM general plugin entry point: installs the prefix-splice hook when NEMO_GYM_TOK_PREFIX_SPLICE=1, else nothing."""

from __future__ import annotations

import logging
import os


def register() -> None:
    """Called by vLLM in each of its processes; inert unless the hook is switched on."""
    if os.environ.get("NEMO_GYM_TOK_PREFIX_SPLICE") != "1":
        return
    _log_through_vllm()
    # Installed in every vLLM process (cheap, idempotent); only the API server ever calls the wrapped methods.
    from nemo_gym_tok.vllm.hook import install

    install()


def _log_through_vllm() -> None:
    """Send this package's log records to vLLM's own log handlers.

    vLLM configures only its `vllm` logger; records of other loggers reach Python's last-resort handler, which drops
    everything below WARNING, so the hook's start-up line (the turn closers it detected) never reached the server
    log. Left alone when vLLM's logging is switched off (VLLM_CONFIGURE_LOGGING=0: no handlers on `vllm`) or when
    the `nemo_gym_tok` logger was configured by someone else.
    """
    ours = logging.getLogger("nemo_gym_tok")
    vllm_logger = logging.getLogger("vllm")
    if ours.handlers or ours.level != logging.NOTSET or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm_logger.level)
    ours.propagate = False
