"""The trajectory contract: turn records in, training samples with per-token provenance out.

Standard library only (no torch; :mod:`agentrl.plugins` loads plug-in drift policies): this is the layer
every other package stands on.
"""

from agentrl.trajectory.manager import (
    BRANCHED,
    CLEAN,
    NEW,
    TURN_OUTCOMES,
    TrajectoryManager,
    UnknownSessionError,
    common_prefix_length,
)
from agentrl.trajectory.policies import (
    DRIFT_CUT,
    DRIFT_OUTCOMES,
    FORKED,
    POLICIES,
    REALIGNED,
    Drift,
    DriftPolicy,
    ForkPolicy,
    RealignPolicy,
    TruncatePolicy,
    make_policy,
)
from agentrl.trajectory.provenance import (
    CONTEXT,
    MODEL,
    PROMPT,
    REALIGNED_PROMPT,
    SOURCES,
    Provenance,
    ProvenanceRun,
    TokenProvenance,
)
from agentrl.trajectory.records import TurnRecord
from agentrl.trajectory.sample import STATUSES, Sample, StopReason
from agentrl.trajectory.verify import ProvenanceError, trained_turns, verify, verify_session

__all__ = [
    "BRANCHED",
    "CLEAN",
    "CONTEXT",
    "MODEL",
    "PROMPT",
    "DRIFT_CUT",
    "DRIFT_OUTCOMES",
    "FORKED",
    "NEW",
    "POLICIES",
    "REALIGNED",
    "REALIGNED_PROMPT",
    "SOURCES",
    "STATUSES",
    "TURN_OUTCOMES",
    "Drift",
    "DriftPolicy",
    "ForkPolicy",
    "Provenance",
    "ProvenanceError",
    "ProvenanceRun",
    "RealignPolicy",
    "Sample",
    "StopReason",
    "TokenProvenance",
    "TrajectoryManager",
    "TruncatePolicy",
    "TurnRecord",
    "UnknownSessionError",
    "common_prefix_length",
    "make_policy",
    "trained_turns",
    "verify",
    "verify_session",
]
