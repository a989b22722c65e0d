"""Consensus Monte Carlo: every client samples its sub-posterior once, the server combines."""

from numpyro_fed.infer.consensus.checks import ConsensusWarning
from numpyro_fed.infer.consensus.core import consensus_combine, parametric_combine
from numpyro_fed.infer.consensus.face import ConsensusMC, ConsensusState

__all__ = ["ConsensusMC", "ConsensusState", "ConsensusWarning", "consensus_combine", "parametric_combine"]
