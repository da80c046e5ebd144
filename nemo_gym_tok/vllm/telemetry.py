"""The splice telemetry of in-flight requests, finished while the engine generates and read by the responses."""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from nemo_gym_tok.splice import SplicedPrompt, SpliceError, SpliceResult
from nemo_gym_tok.vllm.request_prefix import as_400

# The hook's one logger, whichever of its modules logs (a server's log filters name it).
logger = logging.getLogger("nemo_gym_tok.vllm.hook")

# Splice telemetry of in-flight requests, by id(request); each entry leaves with its request.
in_flight: dict[int, dict[str, Any] | TelemetryLater] = {}


class TelemetryLater:
    """A splice's telemetry, finished on the event loop while the engine generates (SplicedPrompt.result).

    What is left of a splice once the engine has its prompt (measuring the turn the call adds, which tokenizes that
    turn's template text, and for a chat completion answered whole the verification of the fast path) does not
    change the prompt. The response wrappers start it when vLLM starts reading the engine's outputs: it runs as one
    callback a couple of loop turns later, once vLLM has sent the request to the engine (which runs in its own
    process), and it is awaited before anything goes out. Not a worker thread: rendering is pure Python, and a
    thread holding the GIL would stall the loop that serves every other request. A verification that fails turns
    the answer into a 400 (the splice says why, and a retry takes the full check). A request nobody answers with
    telemetry (/tokenize) verified during the splice and never measures."""

    def __init__(self, spliced: SplicedPrompt) -> None:
        self._spliced = spliced
        self._future: asyncio.Future[SpliceResult] | None = None

    def start(self) -> None:
        if self._future is None:
            loop = asyncio.get_running_loop()
            self._future = loop.create_future()
            # Two turns: the first lets vLLM's generate() reach the engine before the loop is busy here.
            loop.call_soon(lambda: loop.call_soon(self._finish))

    def _finish(self) -> None:
        assert self._future is not None
        if self._future.done():
            return
        try:
            self._spliced.verify()
        except SpliceError as exc:
            self._future.set_exception(exc)
            return
        except Exception as exc:  # noqa: BLE001 - unverified, the answer must not go out: refused, and logged
            logger.exception("nemo_gym_tok: verifying a spliced prompt failed")
            self._future.set_exception(SpliceError(f"the splice could not be verified ({type(exc).__name__}: {exc})"))
            return
        from nemo_gym_tok.vllm import metrics

        clock = metrics.stage_clock()
        try:
            self._future.set_result(self._spliced.result())
        except Exception as exc:  # noqa: BLE001 - handed to whoever awaits the telemetry
            self._future.set_exception(exc)
        clock("turn measurement")

    async def telemetry(self) -> dict[str, Any]:
        from vllm.exceptions import VLLMValidationError

        from nemo_gym_tok.vllm import metrics

        self.start()
        assert self._future is not None
        try:
            with as_400():
                result = await self._future
        except VLLMValidationError:
            raise
        except Exception:  # noqa: BLE001 - the prompt is verified (_finish) and generated; only its report is missing
            logger.exception("nemo_gym_tok: measuring a spliced turn against the template failed")
            return {"applied": True, "template_differed": False, "replaced_tokens": 0}
        metrics.measured(result)
        return result.telemetry()


async def resolve_telemetry(telemetry: dict[str, Any] | TelemetryLater | None) -> dict[str, Any] | None:
    """The telemetry itself, awaited where it is still being measured."""
    return await telemetry.telemetry() if isinstance(telemetry, TelemetryLater) else telemetry


def remember(request: Any, telemetry: dict[str, Any] | TelemetryLater) -> None:
    """Keep `request`'s splice telemetry until its response reads it (dropped with the request)."""
    key = id(request)
    in_flight[key] = telemetry
    weakref.finalize(request, in_flight.pop, key, None)
