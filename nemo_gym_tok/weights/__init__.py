"""Weight updates on the gym's vLLM servers through vLLM's own routes: all servers or none, each failure named, each
push proven by the servers' own log probs."""

from nemo_gym_tok.weights.checkpoint import Checkpoint, check_checkpoint_dir, check_version_label
from nemo_gym_tok.weights.fleet_keeper import FleetKeeper, KeeperError, KeeperEvent
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
from nemo_gym_tok.weights.push import PushReport, ReplicaState, WeightPushError, describe_dropped, push_weights
from nemo_gym_tok.weights.replica import (
    DEV_MODE_ENV,
    PAUSE_MODES,
    STATUS_METHOD,
    PauseMode,
    Replica,
    ReplicaError,
    routed_roots,
    server_root,
    server_roots,
    try_each,
)
from nemo_gym_tok.weights.resync import STARTUP_VERSION, FleetWeights, Resync, ResyncError, peer_probe, resync_worker

__all__ = [
    "DEFAULT_MAX_MEAN_GAP",
    "DEV_MODE_ENV",
    "PAUSE_MODES",
    "PROBE_TOKEN_IDS",
    "STARTUP_VERSION",
    "STATUS_METHOD",
    "Checkpoint",
    "FleetKeeper",
    "FleetWeights",
    "KeeperError",
    "KeeperEvent",
    "PauseMode",
    "ProbeResult",
    "PushReport",
    "Replica",
    "ReplicaError",
    "ReplicaState",
    "Resync",
    "ResyncError",
    "WeightProbe",
    "WeightProbeError",
    "WeightPushError",
    "check_checkpoint_dir",
    "check_version_label",
    "describe_dropped",
    "expected_log_probs",
    "peer_probe",
    "probe_from_checkpoint",
    "probe_replica",
    "push_weights",
    "resync_worker",
    "routed_roots",
    "server_root",
    "server_roots",
    "try_each",
    "verify_replicas",
]
