"""Dynamic loss scaling for float16 mixed-precision training in JAX.

Loss-scale states are immutable pytrees; ``scale`` / ``unscale`` / ``all_finite`` /
``update`` are pure, jit-compiled functions; ``with_loss_scaling`` wraps any optax
optimizer so that non-finite steps are skipped exactly.
"""

from loss_scaling._errors import Failure, LossScaleError, LossScaleWarning
from loss_scaling.autocast import (
    AutocastPolicy,
    AutocastReport,
    autocast,
    autocast_report,
)
from loss_scaling.autocast import Rule as AutocastRule
from loss_scaling.checkpoint.config import check_same_config, restore_with_config
from loss_scaling.checkpoint.flax_record import from_bytes
from loss_scaling.checkpoint.restore import restore_loss_scale
from loss_scaling.checkpoint.state_dict import FORMAT_VERSION, from_state_dict, state_dict
from loss_scaling.checkpoint.upgrade import target_as_saved, upgrade_restored
from loss_scaling.core.scalers import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    loss_scale_for,
)
from loss_scaling.core.tree import all_finite, grads_max, scale, unscale
from loss_scaling.core.update import update
from loss_scaling.grad import value_and_grad
from loss_scaling.integrations.linen import TrainState
from loss_scaling.lookup import get_loss_scale
from loss_scaling.report import check, metrics, nonfinite_grad_paths
from loss_scaling.wrapper.state import SUSPICIOUS_GROWTHS, LossScalingState, UnderflowStats
from loss_scaling.wrapper.transform import apply_gradients, with_loss_scaling

__version__ = "0.1.0"

__all__ = [
    "AutocastPolicy",
    "AutocastReport",
    "AutocastRule",
    "DynamicLossScale",
    "FORMAT_VERSION",
    "Failure",
    "Float16Report",
    "LayerHeadroom",
    "LossScale",
    "LossScaleError",
    "LossScaleWarning",
    "LossScalingState",
    "NoOpLossScale",
    "OverflowReport",
    "SUSPICIOUS_GROWTHS",
    "StaticLossScale",
    "TrainState",
    "UnderflowStats",
    "all_finite",
    "apply_gradients",
    "autocast",
    "autocast_report",
    "check",
    "check_same_config",
    "find_overflow",
    "float16_report",
    "from_bytes",
    "from_state_dict",
    "get_loss_scale",
    "grads_max",
    "loss_scale_for",
    "metrics",
    "nonfinite_grad_paths",
    "orbax_restore",
    "orbax_save_args",
    "restore_loss_scale",
    "restore_with_config",
    "scale",
    "state_dict",
    "target_as_saved",
    "unscale",
    "update",
    "upgrade_restored",
    "value_and_grad",
    "with_loss_scaling",
]

# Imported on first use: `import loss_scaling` never imports Orbax, flax.nnx or Equinox,
# nor the debugging tools (loss_scaling.debug), which no training step needs.
_LAZY = {"orbax_save_args": ("loss_scaling.checkpoint.orbax", "save_args"),
         "orbax_restore": ("loss_scaling.checkpoint.orbax", "restore"),
         **{name: ("loss_scaling.debug", name) for name in (
             "find_overflow", "float16_report", "OverflowReport", "Float16Report",
             "LayerHeadroom")}}


def __getattr__(name: str) -> object:
    """``loss_scaling.nnx`` / ``loss_scaling.equinox`` and the Orbax helpers, imported on
    first use; a renamed name, with a ``DeprecationWarning`` (``_deprecation.RENAMES``)."""
    import importlib

    from loss_scaling._deprecation import package_alias

    if name in ("nnx", "equinox", "orbax", "debug"):
        return importlib.import_module(f"loss_scaling.{name}")
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    renamed = package_alias(name)
    if renamed is not None:  # an old name: its new one, with a DeprecationWarning
        renamed.warn()
        if "." in renamed.new:  # outside the package: optax's (a dependency), named here
            import optax  # so that the import is one a reader (and test_architecture) sees

            return getattr(optax, renamed.new.removeprefix("optax."))
        return globals()[renamed.new] if renamed.new in globals() else __getattr__(renamed.new)
    raise AttributeError(f"module 'loss_scaling' has no attribute {name!r}")
