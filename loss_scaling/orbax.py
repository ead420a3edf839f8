"""``loss_scaling.orbax``: the public path of :mod:`loss_scaling.checkpoint.orbax`.

Imported on first use (``import loss_scaling`` does not import it).
"""

from loss_scaling.checkpoint.orbax import LOSS_SCALE_ITEM, STATE_ITEM, restore, save_args

__all__ = ["LOSS_SCALE_ITEM", "STATE_ITEM", "restore", "save_args"]
