"""vLLM general plugin entry point: the prefix-splice hook when NEMO_GYM_TOK_PREFIX_SPLICE=1, the exact weight reload
with it or alone (NEMO_GYM_TOK_EXACT_RELOAD=1), else nothing."""

from __future__ import annotations

import logging
import os


def register() -> None:
    """Called by vLLM in each of its processes; inert unless the hook or the exact reload is switched on."""
    hook_on = os.environ.get("NEMO_GYM_TOK_PREFIX_SPLICE") == "1"
    if not hook_on and os.environ.get("NEMO_GYM_TOK_EXACT_RELOAD") != "1":
        return
    _log_through_vllm()
    # The worker (in the engine process) reloads weights; the wrapper is inert in the API-server processes.
    from nemo_gym_tok.vllm.exact_reload import install_exact_reload
    from nemo_gym_tok.vllm.route_auth import guard_weight_routes

    install_exact_reload()
    guard_weight_routes()  # read by vLLM's API-key middleware in the API-server processes
    if not hook_on:
        return
    # Installed in every vLLM process (cheap, idempotent); only the API server ever calls the wrapped methods.
    from nemo_gym_tok.vllm.hook import install

    install()


class _ThroughVLLM(logging.Handler):
    """Hands each record to the `vllm` logger's handlers as they are when the record is emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _log_through_vllm() -> None:
    """Send this package's log records to vLLM's own log handlers.

    vLLM configures only its `vllm` logger (and does so from the command line, after plugins load in the API server
    process); records of other loggers reach Python's last-resort handler, which drops everything below WARNING, so
    the hook's start-up line (the turn closers it detected) never reached the server log. Left alone when vLLM's
    logging is switched off (VLLM_CONFIGURE_LOGGING=0) or when the `nemo_gym_tok` logger was configured by the user.
    """
    ours = logging.getLogger("nemo_gym_tok")
    if ours.handlers or ours.level != logging.NOTSET or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    ours.addHandler(_ThroughVLLM())
    level = logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    ours.setLevel(level if isinstance(level, int) else logging.INFO)
    ours.propagate = False
