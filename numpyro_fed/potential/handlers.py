"""The two effect handlers behind every party's view of a model: masking what a party does
not own (:class:`mask_unowned`) and substituting unconstrained values as NumPyro's potential
energy does (:class:`unconstrain`)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import jax.numpy as jnp

from numpyro.handlers import substitute

# Private NumPyro helper, for want of a public one: _unconstrain_reparam is what NumPyro's own
# potential_energy uses to map unconstrained values to sites (with the Jacobian terms);
# re-implementing it would let the split drift from NumPyro's potential, which the split must
# equal to round-off.
from numpyro.infer.util import _unconstrain_reparam
from numpyro.primitives import Messenger

__all__ = ["mask_unowned", "unconstrain"]


class mask_unowned(Messenger):
    """Masks the log-density of every site, or row of a site, that the current view does not own.

    ``masks`` maps a federated plate name to a row mask (or a Python bool); sites outside
    federated plates get ``global_mask``. Enumerated discrete sites are left unmasked: they
    are normalised, so once everything depending on them is masked they sum out to one.
    """

    def __init__(self, fn=None, *, masks: Mapping[str, Any], global_mask: bool, enumerated: bool):
        self.masks = masks
        self.global_mask = global_mask
        self.enumerated = enumerated
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] != "sample":
            return
        if self.enumerated and not msg["is_observed"] and msg["fn"].has_enumerate_support:
            return
        frames = [f for f in msg["cond_indep_stack"] if f.name in self.masks]
        if not frames:
            mask = self.global_mask
        else:
            frame = frames[0]
            mask = self.masks[frame.name]
            if not isinstance(mask, bool):
                mask = jnp.reshape(mask, (-1,) + (1,) * (-frame.dim - 1))
        if mask is True:
            return
        msg["fn"] = msg["fn"].mask(mask)


class unconstrain(substitute):
    """Substitutes unconstrained values exactly as :func:`numpyro.infer.util.potential_energy`."""

    def __init__(self, fn, params):
        super().__init__(fn, substitute_fn=partial(_unconstrain_reparam, params))
