"""The SVGD family: distributed Stein variational gradient descent (Kassab & Simeone) and the
baselines of its paper.

Layout (data flows down):

* :mod:`.kernels`, :mod:`.kde`, :mod:`.whitening`, :mod:`.curvature`, :mod:`.cavity`: the
  RBF kernel and its bandwidths, the KDEs that stand for DSVGD's densities, the changes of
  coordinates that make a round independent of the parameters' units, and the carrier and
  damped cavity that keep every round's target proper;
* :mod:`.optim`: AdaGrad with momentum as optax pieces (every ``optim`` argument takes any
  optax ``GradientTransformation``);
* :mod:`.svgd`: SVGD's step on a score function, ``step(rng_key, state) -> (state, info)``,
  and loops of it;
* the algorithms' cores, one per algorithm, pure and BlackJAX-shaped, written once against
  the federation seam: ``init``, ``client_functions`` (what a client runs where it lives)
  and ``build_kernel`` returning the round ``step(rng_key, state, federation, ...) ->
  (state, info)``, which on :class:`~numpyro_fed.federation.InProcess` compiles into one
  program: :mod:`.dsvgd` (its client's factor in a round: :mod:`.factors`), :mod:`.pdsvgd`,
  :mod:`.udsvgd` and the baselines'
  :mod:`.pooled_svgd`, :mod:`.fedavg`, :mod:`.sgld`; :mod:`.local`, DSVGD's client step on
  joint particles ``(theta, z_k)`` in a model with client-local latents;
* :mod:`.model`: a NumPyro model's split potential as flat gradient functions, prior draws,
  minibatch gradients; :mod:`.client_order`; :mod:`.checks` (Stein's identity);
* (Gaussian PVI, the paper's other baseline, is :class:`numpyro_fed.GaussianPVI` in
  :mod:`numpyro_fed.infer.pvi`.)
* the faces, mirroring :class:`numpyro.infer.SVI`: :class:`DSVGD`, :class:`PDSVGD`,
  :class:`UDSVGD` (:mod:`.methods`), :class:`SVGD`, :class:`FedAvg`,
  :class:`DistributedSGLD` (:mod:`.baselines`), all over
  :class:`~numpyro_fed.infer.base.VariationalMethod` (:mod:`.face`): their
  :class:`~numpyro_fed.infer.RunResult` converts with :func:`numpyro_fed.to_inference_data`.
"""

from numpyro_fed.infer.stein.baselines import SVGD, DistributedSGLD, FedAvg
from numpyro_fed.infer.stein.dsvgd import DSVGDInfo, DSVGDState, LocalState
from numpyro_fed.infer.stein.face import ParticleMethod, kernel_stein_discrepancy
from numpyro_fed.infer.stein.kde import kde_grad_log_density, kde_log_density, shrunk_kde
from numpyro_fed.infer.stein.kernels import median_bandwidth, rbf_kernel, svgd_direction, wide_median_bandwidth
from numpyro_fed.infer.stein.methods import DSVGD, PDSVGD, UDSVGD
from numpyro_fed.infer.stein.optim import adagrad_momentum, scale_by_adagrad_momentum
from numpyro_fed.infer.stein.pdsvgd import PDSVGDState
from numpyro_fed.infer.stein.svgd import staged_svgd, svgd_run
from numpyro_fed.infer.stein.udsvgd import Buffer, UDSVGDState
from numpyro_fed.infer.stein.whitening import Whitening, whitening

__all__ = [
    "Buffer",
    "DSVGD",
    "DSVGDInfo",
    "DSVGDState",
    "DistributedSGLD",
    "FedAvg",
    "LocalState",
    "PDSVGD",
    "PDSVGDState",
    "ParticleMethod",
    "SVGD",
    "UDSVGD",
    "UDSVGDState",
    "Whitening",
    "adagrad_momentum",
    "kde_grad_log_density",
    "kde_log_density",
    "kernel_stein_discrepancy",
    "median_bandwidth",
    "rbf_kernel",
    "scale_by_adagrad_momentum",
    "shrunk_kde",
    "staged_svgd",
    "svgd_direction",
    "svgd_run",
    "whitening",
    "wide_median_bandwidth",
]
