"""The wrapper's state, its validated options, and its host-side messages.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loss_scaling import _errors
from loss_scaling._deprecation import LAST_STEP_FINITE
from loss_scaling.core.numerics import AxisName
from loss_scaling.core.scalers import LossScale, with_failure, without_failure
from loss_scaling.core.update import OnFailure

SkipMode = Literal["auto", "cond", "select"]
NonFiniteLoss = Literal["backoff", "skip"]
GRADIENT_EXTRA_ARGS = ("grad",)
"""Extra arguments of ``update`` that hold gradients of the scaled loss: unscaled and checked."""
CONSUMED_EXTRA_ARGS = ("loss",)
"""Extra arguments of ``update`` that are the wrapper's own (checked) and not forwarded:
optax's line searches (``lbfgs``) and ``optax.contrib.sam`` refuse arguments they do not
know. An inner optimizer that wants the loss takes it as ``value=``, optax's name."""
REPLAY_EXTRA_ARG = "value_fn"
"""The loss function (of the params, unscaled) that a replay differentiates again; also
forwarded to an inner optimizer whose ``update`` takes it (optax's line searches)."""
MAX_NONFINITE_LOSSES = 16
"""The default ``max_nonfinite_losses`` (16 backoffs take the default scale to 0.5)."""
MAX_REPLAYS = 64
"""The largest ``max_replays``: 64 backoffs by 0.5 take any float32 scale below 2**-40."""


class LossScalingState(NamedTuple):
    """State of :func:`with_loss_scaling`.

    Attributes:
      scaler: the loss-scale state (``NoOpLossScale``, ``StaticLossScale`` or
        ``DynamicLossScale``) that scales the *next* step's loss. A ``DynamicLossScale``
        here has no ``failure`` leaf: ``failure`` below is the one register
        (:func:`loss_scaling.get_loss_scale` returns the scaler with it).
      inner_state: the wrapped optimizer's state; unchanged by skipped steps.
      skipped_steps: int32, steps skipped in total (saturating).
      consecutive_skips: int32, steps skipped since the last applied one (saturating):
        0 exactly when the last step was applied (:attr:`last_step_applied`).
      nonfinite_loss_steps: int32, steps skipped because the ``loss`` passed to the
        update was itself non-finite (saturating).
      consecutive_nonfinite_losses: int32, steps in a row whose ``loss`` was non-finite
        (saturating): a step given a finite loss, or none, sets it to 0. What
        ``max_nonfinite_losses`` counts (a forward pass that keeps failing), where
        ``consecutive_skips`` also counts the gradient overflows before it.
      nonfinite_grads: bool vector with one entry per gradient leaf, in
        ``jax.tree.leaves`` order: ``True`` where that gradient leaf was non-finite on the
        most recent step skipped for its gradients (:func:`loss_scaling.nonfinite_grad_paths`
        names them). A vector, not a params-shaped tree: ``optax.tree_map_params``
        (sharding specs for optimizer states) must not mistake it for params.
      failure: int32 :class:`loss_scaling.Failure` code, 0 while healthy. Once set it never
        changes: every later step is skipped and :func:`loss_scaling.check` raises.
      failure_skips: int32, the count that ended the run: ``consecutive_skips`` when it
        failed, or for ``Failure.NONFINITE_LOSS`` ``consecutive_nonfinite_losses``
        (0 while healthy).
      clean_growths: int32, growths of the scale since the last non-finite step. Many in a
        row point at a loss that was not scaled, or a model that needs no scaling
        (``metrics(...)["scale_suspicious"]``, and a warning from :func:`loss_scaling.check`).
      underflow: ``None``, or with ``underflow_diagnostics=True`` an
        :class:`UnderflowStats` of this step's gradients.
      grad_norm: float32, the global L2 norm of the last step's *unscaled* gradients
        (PyTorch's ``clip_grad_norm_`` value), from the same read as the finite test. inf
        on a step skipped for its gradients, and where the squares of the *scaled*
        gradients overflow float32 (a total norm above ~1.8e19). With ``axis_name``, the
        same on every replica (shards of a split leaf add up). 0 before the first step.
      replays: int32, batches recomputed at a backed-off scale in total (saturating): each
        replay is one more forward and backward pass inside the step
        (``max_replays``, docs/replay.md). A replayed step that ends finite is applied.
      last_step_replays: int32, the replays of the last step (0 when its first pass was
        finite, or replay is off).
    """

    scaler: LossScale
    inner_state: optax.OptState
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    nonfinite_loss_steps: jax.Array
    consecutive_nonfinite_losses: jax.Array
    nonfinite_grads: jax.Array
    failure: jax.Array
    failure_skips: jax.Array
    clean_growths: jax.Array
    underflow: UnderflowStats | None
    grad_norm: jax.Array
    replays: jax.Array
    last_step_replays: jax.Array

    @property
    def last_step_applied(self) -> jax.Array:
        """bool: whether the last step was applied (its gradients, and the loss when given,
        finite; the state healthy). Derived, not stored: an applied step resets
        ``consecutive_skips`` and a skipped one makes it positive (it saturates)."""
        return self.consecutive_skips == 0

    @property
    def last_step_finite(self) -> jax.Array:
        """Deprecated: :attr:`last_step_applied` (a field of the state until 250089d)."""
        LAST_STEP_FINITE.warn()
        return self.last_step_applied


MAY_HOLD_NO_LEAVES = frozenset({"scaler", "inner_state", "underflow"})
"""The fields of :class:`LossScalingState` that can hold no leaves (a ``NoOpLossScale``,
an empty inner state, no underflow statistics): a mapping of the state's fields, as an
``nnx.State`` holds it, drops them."""
ALWAYS_PRESENT = frozenset(LossScalingState._fields) - MAY_HOLD_NO_LEAVES
"""The fields that always hold leaves, whatever the options."""


def is_state_mapping(node: Any) -> bool:
    """Whether ``node`` is a wrapper state as an ``nnx.State`` holds it: a mapping of its
    fields, those without leaves dropped (:data:`MAY_HOLD_NO_LEAVES`)."""
    return isinstance(node, Mapping) and ALWAYS_PRESENT <= set(node) <= set(
        LossScalingState._fields)


class UnderflowStats(NamedTuple):
    """Per gradient leaf, how much of the last step's gradient float16 could not hold.

    A step whose gradients are not finite keeps the previous values.

    Attributes:
      zero: float32 vector, one entry per gradient leaf: the fraction of entries that are
        exactly zero (in the scaled gradients: what underflowed in the backward pass).
      small: float32 vector: the fraction of entries that are nonzero but, unscaled, below
        float16's smallest normal (6.1e-5): what float16 would lose without the scale.
        A complex entry is zero when both its parts are, and small when it is nonzero
        with an unscaled modulus below 6.1e-5; so ``zero + small`` never exceeds 1.
      size: int32 vector: the entries of each floating leaf (0 for integer leaves), which
        weigh the overall fractions.
    """

    zero: jax.Array
    small: jax.Array
    size: jax.Array


SUSPICIOUS_GROWTHS = 20
"""Growths in a row without an overflow after which the scale is suspicious (2**20 up)."""


# The fix both warnings about narrow params give.
_MASTER_PARAMS = ("Keep float32 master params and compute in {dtype} inside the loss function "
                  "(cast the params there), as the README's recipes do.")
LOW_PRECISION_STATE = (
    "with_loss_scaling: the params {leaves} are {dtype} and the wrapped optimizer keeps its "
    "state in the params' dtype. In {dtype} that state under- and overflows (Adam's eps=1e-8 "
    "is 0 in float16: one step turns params into NaN, and no gradient check can catch it). "
) + _MASTER_PARAMS
NARROW_PARAMS = (
    "with_loss_scaling: the params {leaves} are {dtype}. {dtype} keeps {bits} significant "
    "bits, so an update smaller than about 1/{ratio} of a param rounds away (p + u == p): "
    "small learning rates and late training stall, and loss scaling cannot help (it "
    "protects the gradients, not the params). "
) + _MASTER_PARAMS

NO_ZERO_PARAMS = (
    "with_loss_scaling: the params leaf {leaf!r} is {dtype}, a dtype without a zero (an "
    "exponent-only scale format): no update leaves it unchanged (a skipped step's -0.0 update "
    "is NaN in {dtype}, and optax.apply_updates computes p + u in it), so a skipped step "
    "cannot keep it. Keep such leaves out of the params given to the optimizer (e.g. in "
    "another collection), or store them as float32."
)


class WrapperOptions(NamedTuple):
    """The wrapper's settings, shared by ``update`` and the fused :func:`apply_gradients`."""

    inner: optax.GradientTransformationExtraArgs
    axis_name: AxisName
    skip: SkipMode
    on_failure: OnFailure
    max_consecutive_skips: int | None
    nonfinite_loss: NonFiniteLoss
    underflow_diagnostics: bool
    max_replays: int = 0
    max_nonfinite_losses: int | None = None


def attach_options(update: Any, options: WrapperOptions, initial_scaler: LossScale) -> None:
    """Sets the options on the wrapper's ``update`` function, where the fused path
    (:func:`options_of`) and the placement checks find them; on the function, so that a
    transformation rebuilt around ``tx.init`` / ``tx.update``
    (``GradientTransformationExtraArgs(tx.init, tx.update)``) keeps them. The scaler given
    to ``with_loss_scaling`` goes with them (the provenance checks compare with it)."""
    update.options = options
    update.initial_scaler = initial_scaler


def options_of(update: Any) -> WrapperOptions | None:
    """The options of a wrapper's ``update`` function (:func:`attach_options`); ``None``
    for any other function."""
    options = getattr(update, "options", None)
    return options if isinstance(options, WrapperOptions) else None


def initial_scaler_of(update: Any) -> LossScale | None:
    """The scaler given to the ``with_loss_scaling`` whose ``update`` this is, or None."""
    return getattr(update, "initial_scaler", None) if options_of(update) else None


def initial_state(scaler: LossScale, inner_state: Any, n_grads: int,
                  underflow_diagnostics: bool) -> LossScalingState:
    """The state ``init`` returns: every leaf with an explicit dtype; a failed scaler
    (restored from its state dict) fails the wrapper."""
    return LossScalingState(
        scaler=without_failure(scaler),  # its code in the state's one register
        inner_state=inner_state,
        skipped_steps=jnp.zeros((), jnp.int32),
        consecutive_skips=jnp.zeros((), jnp.int32),
        nonfinite_loss_steps=jnp.zeros((), jnp.int32),
        consecutive_nonfinite_losses=jnp.zeros((), jnp.int32),
        nonfinite_grads=jnp.zeros((n_grads,), jnp.bool_),
        failure=carried_failure(jnp.zeros((), jnp.int32), scaler),  # a failed scaler's
        failure_skips=jnp.zeros((), jnp.int32),
        clean_growths=jnp.zeros((), jnp.int32),
        underflow=UnderflowStats(jnp.zeros((n_grads,), jnp.float32),
                                 jnp.zeros((n_grads,), jnp.float32),
                                 jnp.zeros((n_grads,), jnp.int32))
        if underflow_diagnostics else None,
        grad_norm=jnp.zeros((), jnp.float32),
        replays=jnp.zeros((), jnp.int32),
        last_step_replays=jnp.zeros((), jnp.int32),
    )


def carried_failure(failure: jax.Array, new: LossScale) -> jax.Array:
    """The wrapper's failure register once ``new``, a scaler on its own, is its scaler
    (``init``, ``restore_loss_scale``; held as :func:`without_failure`): a failed run
    stays failed, and a failed scaler fails it."""
    code = getattr(new, "failure", None)
    if code is None:
        return failure
    return jnp.where(failure != 0, failure, jnp.asarray(code, jnp.int32)).astype(jnp.int32)


def scaler_alone(state: LossScalingState) -> LossScale:
    """The wrapper's scaler as a state on its own (what ``get_loss_scale`` returns): a
    ``DynamicLossScale`` with the wrapper's register as its ``failure``, so that its
    state dict and ``ls.check`` say a failed run failed (its arrays: the state's own)."""
    return with_failure(state.scaler, state.failure)


def differentiated(params: Any) -> Any:
    """What the gradients are of (and replay's ``value_fn`` takes): the params, or with
    ``optax.lookahead``, whose ``params`` are ``LookaheadParams(fast, slow)``, the fast ones."""
    return params.fast if isinstance(params, optax.LookaheadParams) else params


def _has_zero(dtype: Any) -> bool:
    """Whether ``dtype`` holds a zero (``float8_e8m0fnu``, a scale format, does not)."""
    return bool(np.asarray(0.0, np.float32).astype(dtype).astype(np.float32) == 0)


def refuse_dtypes_without_zero(params: Any) -> None:
    """Host side, at ``init``: float params in a dtype without a zero cannot be skipped."""
    for name, leaf in zip(key_path_names(params), jax.tree.leaves(params), strict=True):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and not _has_zero(dtype):
            raise TypeError(NO_ZERO_PARAMS.format(leaf=name, dtype=jnp.dtype(dtype).name))


def warn_low_precision_state(params: Any, inner_state: Any) -> None:
    """Host side, once at ``init``: narrow float params whose optimizer state is as narrow,
    and float16 or bfloat16 params (a :class:`loss_scaling.LossScaleWarning` each)."""
    def narrow(x: Any) -> bool:
        dtype = getattr(x, "dtype", None)
        return (dtype is not None and jnp.issubdtype(dtype, jnp.floating)
                and jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp)

    def shown(names: list[str]) -> str:
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    named = list(zip(key_path_names(params), jax.tree.leaves(params), strict=True))
    names = [name for name, leaf in named if narrow(leaf)]
    if names and any(narrow(leaf) for leaf in jax.tree.leaves(inner_state)):
        dtype = next(leaf.dtype for leaf in jax.tree.leaves(params) if narrow(leaf))
        warnings.warn(LOW_PRECISION_STATE.format(leaves=shown(names),
                                                 dtype=jnp.dtype(dtype).name),
                      _errors.LossScaleWarning, stacklevel=3)
        return
    for dtype in (jnp.float16, jnp.bfloat16):  # whatever the optimizer: the params
        held = [name for name, leaf in named if getattr(leaf, "dtype", None) == dtype]
        if held:                                # themselves lose the updates
            bits = jnp.finfo(dtype).nmant + 1
            warnings.warn(NARROW_PARAMS.format(leaves=shown(held), dtype=jnp.dtype(dtype).name,
                                               bits=bits, ratio=2**bits),
                          _errors.LossScaleWarning, stacklevel=3)


def wrapper_failure_message(state: LossScalingState, names: list[str] | None = None) -> str:
    """The host-side message for a failed wrapper state (concrete, one replica):
    :func:`loss_scaling._errors.failure_message` of its register, with its count.

    ``names`` names the gradient leaves (:func:`key_path_names` of the params or gradients);
    without them, leaves are named by their index in ``jax.tree.leaves`` order.
    """
    flags = np.asarray(state.nonfinite_grads).reshape(-1)
    if names is None or len(names) != flags.size:
        names = [f"leaf #{i}" for i in range(flags.size)]
    return _errors.failure_message(
        state.failure, scale=state.scaler.loss_scale, count=state.failure_skips,
        backoff_factor=getattr(getattr(state.scaler, "config", None), "backoff_factor", None),
        leaves=[name for name, bad in zip(names, flags, strict=True) if bad])


def key_path_names(tree: Any) -> list[str]:
    """Dotted key paths of the leaves (``"encoder.layers.0.w"``), made unique."""
    names: list[str] = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator=".") or "params"
        while name in names:  # e.g. {"a.b": x} next to {"a": {"b": y}}
            name += "_"
        names.append(name)
    return names
