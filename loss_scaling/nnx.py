"""``loss_scaling.nnx``: the public path of :mod:`loss_scaling.integrations.nnx`.

Imported on first use (``import loss_scaling`` does not import it).
"""

from loss_scaling.integrations.nnx import Optimizer, value_and_grad

__all__ = ["Optimizer", "value_and_grad"]
