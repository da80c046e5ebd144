"""A served gym process collects garbage rarely and leaves what start-up built out of every collection."""

from __future__ import annotations

import subprocess
import sys

from nemo_gym_tok.servers.serve import YOUNG_COLLECTION_THRESHOLD


def test_quiet_garbage_collector_raises_the_young_threshold_and_freezes_start_up() -> None:
    script = (
        "import gc; from nemo_gym_tok.servers.serve import quiet_garbage_collector as q; "
        "before = gc.get_threshold(); q(); print(gc.get_threshold()[0], gc.get_threshold()[1:] == before[1:], "
        "gc.get_freeze_count() > 1000)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(YOUNG_COLLECTION_THRESHOLD), "True", "True"]
