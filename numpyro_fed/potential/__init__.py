"""The exact split of a model's potential energy into a prior term and one term per client
(:mod:`~numpyro_fed.potential.federated`), read from the model's trace
(:mod:`~numpyro_fed.potential.trace`) and built from each party's view of the model
(:mod:`~numpyro_fed.potential.views`, with the handlers of :mod:`~numpyro_fed.potential.handlers`);
:mod:`~numpyro_fed.potential.deployment` for rows that stay on the clients."""

from numpyro_fed.potential.deployment import GroupIndex
from numpyro_fed.potential.federated import FederatedPotential, FlatPotential, split_potential
from numpyro_fed.potential.trace import PlateInfo

__all__ = ["FederatedPotential", "GroupIndex", "FlatPotential", "PlateInfo", "split_potential"]
