"""``loss_scaling.equinox``: the public path of :mod:`loss_scaling.integrations.equinox`.

Imported on first use (``import loss_scaling`` does not import it).
"""

from loss_scaling.integrations.equinox import apply_gradients, filter_value_and_grad

__all__ = ["apply_gradients", "filter_value_and_grad"]
