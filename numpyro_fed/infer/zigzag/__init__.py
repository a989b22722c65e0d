"""Federated Zig-Zag sampler (Federated PDMC, Bierkens & Duncan 2022, Algorithm 2).

The package in the order data flows through it:

* :mod:`~numpyro_fed.infer.zigzag.proposers`: the clients' functions (each from its own rows
  and what the server sends) and the server's view of them, :class:`Proposers`;
* :mod:`~numpyro_fed.infer.zigzag.control_variates`: the shifts that re-split the clients'
  terms around a reference point;
* :mod:`~numpyro_fed.infer.zigzag.bounds`: bounds on the rates along the current line;
* :mod:`~numpyro_fed.infer.zigzag.proposals`: every proposer's next event time;
* :mod:`~numpyro_fed.infer.zigzag.kernel`: the core, :func:`init`, :func:`step` (one
  proposal, thinned by the server) and :func:`advance` / :func:`build_kernel` (a duration of
  process time), pure ``(rng_key, state, ...) -> (state, info)`` functions;
* :mod:`~numpyro_fed.infer.zigzag.federated`: the same process through a
  :class:`~numpyro_fed.federation.Federation`: Algorithm 2 as messages, each client finding
  its own next switching time on its own rows (:func:`client_proposal`), the server taking
  the earliest (:func:`build_federated_kernel`);
* :mod:`~numpyro_fed.infer.zigzag.mode`, :mod:`~numpyro_fed.infer.zigzag.preconditioning`,
  :mod:`~numpyro_fed.infer.zigzag.setup` (the set-up calls through a federation),
  :mod:`~numpyro_fed.infer.zigzag.subsample_setup` (the subsampling's bounds),
  :mod:`~numpyro_fed.infer.zigzag.warmup`: what the face sets up and adapts;
* :mod:`~numpyro_fed.infer.zigzag.sampler`: :class:`FedZigZag`, the NumPyro ``MCMCKernel``
  (its settings checked by :mod:`~numpyro_fed.infer.zigzag.options`, its clients' program
  in :mod:`~numpyro_fed.infer.zigzag.program`, a draw in
  :mod:`~numpyro_fed.infer.zigzag.draws`); :mod:`~numpyro_fed.infer.zigzag.diagnostics`
  reads its recorded infos and message ledger.

The package exports what users and those who build on the core need; the rest is
importable from its module.
"""

from numpyro_fed.infer.zigzag.bounds import GradientBound, HessianBound, per_proposer_bound
from numpyro_fed.infer.zigzag.control_variates import ControlVariates, control_variate_reference
from numpyro_fed.infer.zigzag.draws import FedZigZagState
from numpyro_fed.infer.zigzag.kernel import advance, build_kernel, init, kernel_config, step
from numpyro_fed.infer.zigzag.mode import ModeSearch, OtherMode
from numpyro_fed.infer.zigzag.preconditioning import Preconditioner, precondition
from numpyro_fed.infer.zigzag.proposers import (
    ClientFunctions,
    Proposers,
    client_functions,
    in_process_proposers,
    proposers_from_potential,
)
from numpyro_fed.infer.zigzag.sampler import FedZigZag
from numpyro_fed.infer.zigzag.state import KernelConfig, SampleInfo, StepInfo, ZigZagState
from numpyro_fed.infer.zigzag.subsample import RowHessianBound
from numpyro_fed.infer.zigzag.warmup import WarmupState

__all__ = [
    "ClientFunctions",
    "ControlVariates",
    "FedZigZag",
    "FedZigZagState",
    "GradientBound",
    "HessianBound",
    "KernelConfig",
    "ModeSearch",
    "OtherMode",
    "Preconditioner",
    "Proposers",
    "RowHessianBound",
    "SampleInfo",
    "StepInfo",
    "WarmupState",
    "ZigZagState",
    "advance",
    "build_kernel",
    "client_functions",
    "control_variate_reference",
    "in_process_proposers",
    "init",
    "kernel_config",
    "per_proposer_bound",
    "precondition",
    "proposers_from_potential",
    "step",
]
