"""Starts a NeMo Gym server from its installed package for `ngt run`: an instance whose fields name `nemo_gym_python`.

NeMo Gym's launcher (`gym env start`) builds a venv per server with uv and needs Ray; its servers themselves only need
what it hands each process: in the server's folder, `python app.py` with the installed package on PYTHONPATH, the
config NeMo Gym's parser resolved in NEMO_GYM_CONFIG_DICT and the instance's top-level key in NEMO_GYM_CONFIG_PATH.
This module does exactly that with the Python the config names (one with `nemo-gym` installed: NeMo Gym needs Python
3.13, so it is rarely the Python running `ngt`).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from nemo_gym_tok.common.exact_json import loads_exact
from nemo_gym_tok.common.managed_process import ManagedProcess
from nemo_gym_tok.config import ServerInstance
from nemo_gym_tok.servers.auth import AUTH_TOKEN_ENV

NEMO_GYM_PYTHON_KEY = "nemo_gym_python"
"""Instance field: the Python (with `nemo-gym` installed) that runs this NeMo Gym server; its other fields are the
server's NeMo Gym config (`domain` is required for resources servers; `entrypoint` defaults to app.py)."""
RESOLVER = Path(__file__).with_name("nemo_gym_resolve.py")
RESOLVE_TIMEOUT_SECONDS = 120.0


class NeMoGymStartError(RuntimeError):
    """The NeMo Gym server could not be started; the message names the instance and says what to fix."""


def is_nemo_gym_instance(instance: ServerInstance) -> bool:
    return NEMO_GYM_PYTHON_KEY in instance.fields


def start_nemo_gym_server(
    instance: ServerInstance,
    host: str,
    port: int,
    *,
    die_with_parent: bool = False,
) -> ManagedProcess:
    """Resolve the instance's config with NeMo Gym's parser and start its server process on `host`:`port`, in a
    process group of its own (`die_with_parent`: ManagedProcess.start's, for the launcher)."""
    where = f"{instance.name}.{instance.kind}.{instance.implementation}"
    python = instance.fields[NEMO_GYM_PYTHON_KEY]
    if not isinstance(python, str) or not os.access(python, os.X_OK):
        raise NeMoGymStartError(
            f"{where}.{NEMO_GYM_PYTHON_KEY}: {python!r} is not an executable Python "
            "(name the python of a venv with nemo-gym installed)"
        )
    # As NeMo Gym reads them: its own keys (domain, entrypoint...) back in, references as {type, name}.
    fields: dict[str, Any] = {k: v for k, v in instance.nemo_gym_fields().items() if k != NEMO_GYM_PYTHON_KEY}
    fields.setdefault("entrypoint", "app.py")
    fields.update(host=host, port=port)
    spec = {instance.name: {instance.kind: {instance.implementation: fields}}}
    try:
        out = subprocess.run(
            [python, str(RESOLVER), json.dumps(spec)], capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_SECONDS
        )
    except subprocess.TimeoutExpired:
        raise NeMoGymStartError(f"{where}: NeMo Gym's config parser did not answer in {RESOLVE_TIMEOUT_SECONDS:g}s")
    if out.returncode != 0:
        raise NeMoGymStartError(
            f"{where}: NeMo Gym's config parser ({python}) refused the instance:\n{out.stderr.strip()[-2000:]}"
        )
    resolved = loads_exact(out.stdout)
    root = Path(resolved["root"])
    folder = root / instance.kind / instance.implementation
    entrypoint = folder / str(fields["entrypoint"])
    if not entrypoint.is_file():
        raise NeMoGymStartError(
            f"{where}: the NeMo Gym package at {root} has no {instance.kind}/"
            f"{instance.implementation}/{fields['entrypoint']} (a server NeMo Gym ships?)"
        )
    env = {**os.environ, "NEMO_GYM_CONFIG_DICT": resolved["config_yaml"], "NEMO_GYM_CONFIG_PATH": instance.name}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env.pop(AUTH_TOKEN_ENV, None)  # the gym's token is none of a third-party server's business
    return ManagedProcess.start([python, str(entrypoint)], cwd=folder, env=env, die_with_parent=die_with_parent)
