"""Dynamic loss scaling for float16 mixed-precision training in JAX.

Loss-scale states are immutable pytrees; ``scale`` / ``unscale`` / ``all_finite`` /
``update`` are pure, jit-compiled functions; ``with_loss_scaling`` wraps any optax
optimizer so that non-finite steps are skipped exactly.
"""

from loss_scaling._errors import LossScaleError
from loss_scaling.scalers import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    update,
)
from loss_scaling.train_state import TrainState
from loss_scaling.transform import (
    LossScalingState,
    LossScalingTransformation,
    apply_gradients,
    get_loss_scale,
    metrics,
    value_and_grad,
    with_loss_scaling,
)
from loss_scaling.tree import all_finite, scale, unscale

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "LossScaleError",
    "LossScalingState",
    "LossScalingTransformation",
    "NoOpLossScale",
    "StaticLossScale",
    "TrainState",
    "all_finite",
    "apply_gradients",
    "get_loss_scale",
    "metrics",
    "scale",
    "unscale",
    "update",
    "value_and_grad",
    "with_loss_scaling",
]
