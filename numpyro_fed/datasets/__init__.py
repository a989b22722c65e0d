"""Data loaders (:mod:`~numpyro_fed.datasets.uci`) and the synthetic problems
(:mod:`~numpyro_fed.datasets.synthetic`) of the papers this package reproduces.

Loaders of real data take the path of the files: the package never assumes
where data lives. They return a frozen :class:`Dataset` of numpy float arrays.

Synthetic generators follow the experiment sections of

* Bierkens, Duncan et al. (2022), *Federated Bayesian computation via
  piecewise deterministic Markov chain Monte Carlo* (Fed-PDMC):
  :func:`fed_pdmc_gaussian` (Sec. 6.1), :func:`fed_pdmc_logistic` (Sec. 6.2),
  :func:`student_t_ar1` (Sec. 6.3), :func:`fed_pdmc_lgcp` (App. E.1);
* Tzikas et al. (2024), *Distributed MCMC sampling via ADMM* (D-ADMMS):
  :func:`dadmms_linear` (Sec. 6.2), :func:`dadmms_logistic` (Sec. 6.3);
* Kassab & Simeone, *Federated generalized Bayesian learning via distributed
  Stein variational gradient descent* (DSVGD): :func:`dsvgd_mixture_1d`
  (Sec. 7, Figs. 2-3, App. B.1).

Each takes a ``seed`` for a :func:`numpy.random.default_rng` generator (an
existing :class:`numpy.random.Generator` is also accepted).
"""

from numpyro_fed.datasets.synthetic import *  # noqa: F403
from numpyro_fed.datasets.synthetic import __all__ as _synthetic
from numpyro_fed.datasets.uci import *  # noqa: F403
from numpyro_fed.datasets.uci import __all__ as _uci

__all__ = sorted(_uci + _synthetic)
