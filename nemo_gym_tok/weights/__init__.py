"""Weight updates on the gym's vLLM servers through vLLM's own routes: all servers or none, each failure named, each
push proven by the servers' own log probs."""

from nemo_gym_tok.weights.checkpoint import Checkpoint, check_checkpoint_dir, check_version_label
from nemo_gym_tok.weights.probe import (
    DEFAULT_MAX_MEAN_GAP,
    PROBE_TOKEN_IDS,
    ProbeResult,
    WeightProbe,
    WeightProbeError,
    expected_log_probs,
    probe_from_checkpoint,
    probe_replica,
    verify_replicas,
)
from nemo_gym_tok.weights.push import PushReport, ReplicaState, WeightPushError, push_weights
from nemo_gym_tok.weights.replica import (
    PAUSE_MODES,
    STATUS_METHOD,
    PauseMode,
    Replica,
    ReplicaError,
    server_root,
    server_roots,
    try_each,
)

__all__ = [
    "DEFAULT_MAX_MEAN_GAP",
    "PAUSE_MODES",
    "PROBE_TOKEN_IDS",
    "STATUS_METHOD",
    "Checkpoint",
    "PauseMode",
    "ProbeResult",
    "PushReport",
    "Replica",
    "ReplicaError",
    "ReplicaState",
    "WeightProbe",
    "WeightProbeError",
    "WeightPushError",
    "check_checkpoint_dir",
    "check_version_label",
    "expected_log_probs",
    "probe_from_checkpoint",
    "probe_replica",
    "push_weights",
    "server_root",
    "server_roots",
    "try_each",
    "verify_replicas",
]
