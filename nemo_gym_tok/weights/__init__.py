"""Weight updates on the gym's vLLM servers through vLLM's own routes: all servers or none, each failure named."""

from nemo_gym_tok.weights.checkpoint import Checkpoint, check_checkpoint_dir, check_version_label
from nemo_gym_tok.weights.push import PushReport, ReplicaState, WeightPushError, push_weights
from nemo_gym_tok.weights.replica import PAUSE_MODES, STATUS_METHOD, PauseMode, Replica, ReplicaError, server_root

__all__ = [
    "PAUSE_MODES",
    "STATUS_METHOD",
    "Checkpoint",
    "PauseMode",
    "PushReport",
    "Replica",
    "ReplicaError",
    "ReplicaState",
    "WeightPushError",
    "check_checkpoint_dir",
    "check_version_label",
    "push_weights",
    "server_root",
]
