"""``flax.serialization`` of the scaler states (registered on import): one checked record
(values, shape, CRC-32), restored in the target's configuration and layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from loss_scaling._errors import RestoreError, show
from loss_scaling.checkpoint.record import RecordError, decode, encode
from loss_scaling.checkpoint.state_dict import host_array, is_concrete
from loss_scaling.checkpoint.upgrade import as_saved, saved_at, upgrade_restored
from loss_scaling.core import fields
from loss_scaling.core.scalers import (
    SCALER_TYPES,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    leaf_names,
)
from loss_scaling.wrapper.state import LossScalingState

PRE_LOSS_SCALING = (
    "{where}. Is it a checkpoint written before loss scaling was added? Restore it with its "
    "own structure, then place the old optimizer state into the new one's inner state: "
    "`opt_state = tx.init(params)._replace(inner_state=old_opt_state)` (docs/checkpoints.md, "
    "\"Starting loss scaling from an existing checkpoint\")."
)

def _flax_to_state_dict(scaler: LossScale) -> Any:
    if isinstance(scaler, NoOpLossScale):
        return {}
    record = encode(scaler)
    if record is not None:
        return record
    # Placeholders (None, ShapeDtypeStruct) and tracers: the leaves by name, unchecked.
    return {name: getattr(scaler, name) for name in leaf_names(scaler)}


def _flax_error(message: str) -> RestoreError:
    path = flax.serialization.current_path()
    return RestoreError(f"cannot restore the loss-scale state at {path!r}: {message}")


ADOPT_THE_CONFIG = (
    " If the saved configuration differs, restore the saved state with its own "
    "configuration and adopt the new one with `loss_scaling.restore_with_config`.")


def _flax_leaf(target: LossScale, name: str, value: Any) -> Any:
    """Checks a concrete restored leaf against the target's layout and configuration.

    Placeholders (``None``, ``ShapeDtypeStruct``, tracers) pass through untouched into
    a placeholder target. Anything else must be a numeric array of the target leaf's
    shape (a ``pmap``-ed state has a leading device axis), checked elementwise.
    """
    target_leaf = getattr(target, name, None)
    if value is None or isinstance(value, (jax.ShapeDtypeStruct, jax.core.Tracer)):
        if is_concrete(target_leaf):
            raise _flax_error(f"{name} is {show(value)}, not a value: the saved state was a "
                              "placeholder (e.g. from jax.eval_shape).")
        return value
    try:
        array = np.asarray(value)
    except Exception:  # ragged lists and other junk: still a ValueError
        raise _flax_error(f"{name} must be an array, got {show(value)}.") from None
    integer = not fields.is_float(name)
    if array.dtype.kind not in ("iu" if integer else "f"):
        raise _flax_error(
            f"{name} must be {'an integer' if integer else 'a floating'} array, got "
            f"{show(value)} of dtype {array.dtype}.")
    config = target.config if isinstance(target, DynamicLossScale) else None
    # The target's shape (replica axes included); a None placeholder: an unreplicated leaf.
    expected = tuple(np.shape(target_leaf)) if target_leaf is not None else (
        fields.shape(name, config))
    if array.shape != expected:
        raise _flax_error(
            f"{name} has shape {array.shape}, the target's has shape {expected}: restore into "
            "a target of the saved layout (a pmap-replicated state has a leading device "
            "axis: replicate the target with flax.jax_utils.replicate, or save one replica).")
    try:
        fields.check_leaf(name, array, config, label=name, config_name="the target's ",
                          fix=ADOPT_THE_CONFIG if integer else "")
    except ValueError as error:
        raise _flax_error(str(error)) from None
    if isinstance(target, StaticLossScale) and is_concrete(target_leaf):
        configured = host_array(target_leaf).astype(np.float32)
        if not np.array_equal(array.astype(np.float32), configured):
            raise _flax_error(
                f"loss_scale: saved {show(array.tolist())}, the target's StaticLossScale "
                f"factor is {show(configured.tolist())}. A static factor is configuration: "
                "build the target with the saved factor, or restore into a placeholder "
                "(`jax.tree.map(lambda _: None, target)`) and adopt the new one with "
                "`loss_scaling.restore_with_config`.")
    dtype = np.int32 if integer else np.float32
    if isinstance(value, jax.Array) and value.dtype == dtype:
        return value
    return jnp.asarray(array.astype(dtype))


def _flax_from_state_dict(target: LossScale, state: Any) -> LossScale:
    names = leaf_names(target)
    try:
        if isinstance(state, (bytes, bytearray, memoryview)) and names:
            try:
                state = decode(target, bytes(state))
            except RecordError as error:
                raise _flax_error(str(error)) from None
        if not isinstance(state, Mapping) or set(state) != set(names):
            got = sorted(map(show, state)) if isinstance(state, Mapping) else show(state)
            raise _flax_error(f"expected {'the checked record of' if names else 'a dict with'}"
                              f" the keys {list(names)}, got {got}.")
        leaves = [_flax_leaf(target, name, state[name]) for name in names]
    except RestoreError:
        raise
    except Exception as error:  # hostile state: still a ValueError that names the path
        raise _flax_error(f"{type(error).__name__}: {show(str(error))}") from None
    # Every child of the target counts as one leaf, whatever it holds (even None).
    treedef = jax.tree.structure(target, is_leaf=lambda x: x is not target)
    return jax.tree.unflatten(treedef, leaves)


def _bare_optimizer_states(target: Any, state: Any) -> list[str]:
    """Paths where ``target`` has a ``LossScalingState`` but the decoded ``state`` holds
    a mapping without its ``scaler`` / ``inner_state`` fields (a checkpoint of the bare
    inner optimizer, saved before loss scaling was added)."""
    def is_wrapper(x: Any) -> bool:
        return isinstance(x, LossScalingState)

    bare = []
    for path, node in jax.tree_util.tree_flatten_with_path(target, is_leaf=is_wrapper)[0]:
        saved = saved_at(state, path)
        if is_wrapper(node) and isinstance(saved, Mapping) and not {
                "scaler", "inner_state"} & set(saved):
            bare.append("./" + jax.tree_util.keystr(path, simple=True, separator="/"))
    return bare


def from_bytes(target: Any, encoded: bytes) -> Any:
    """``flax.serialization.from_bytes``, with every failure a ``ValueError``.

    flax decodes the whole message with msgpack before any restore hook runs, so
    truncated bytes or a corrupted byte of msgpack's framing raise msgpack's or flax's
    own errors there, naming no field. This function turns those into a ``ValueError``
    naming the loss-scale states of ``target`` (one ``except ValueError`` handles every
    corrupted checkpoint), and names a checkpoint saved before loss scaling was added.
    Bytes written by an earlier version of loss_scaling, whose loss-scaling state held
    other fields, restore into today's (:func:`loss_scaling.target_as_saved`,
    :func:`loss_scaling.upgrade_restored`), where plain flax refuses them.

    Args:
      target: the restore target, as for ``flax.serialization.from_bytes``.
      encoded: bytes from ``flax.serialization.to_bytes``.

    Returns:
      ``target`` with the restored values.

    Raises:
      ValueError: for anything that does not restore into ``target``: undecodable bytes,
        another structure, a corrupted loss-scale record or invalid values.

    Examples:
      >>> import flax.serialization
      >>> import loss_scaling as ls
      >>> from loss_scaling import from_bytes
      >>> s = ls.update(ls.DynamicLossScale(init_scale=256.0), False)
      >>> data = flax.serialization.to_bytes({"scaler": s})
      >>> float(from_bytes({"scaler": ls.DynamicLossScale()}, data)["scaler"].loss_scale)
      128.0
      >>> from_bytes({"scaler": ls.DynamicLossScale()}, data[:-1])
      Traceback (most recent call last):
      ...
      ValueError: cannot decode the bytes for the loss-scale state at './scaler': ...
    """
    def is_scaler(x: Any) -> bool:
        return isinstance(x, SCALER_TYPES)

    paths = ["./" + jax.tree_util.keystr(path, simple=True, separator="/") for path, node
             in jax.tree_util.tree_flatten_with_path(target, is_leaf=is_scaler)[0]
             if is_scaler(node)]
    where = (f"the loss-scale state at {', '.join(map(repr, paths))}" if paths
             else "a target holding no loss scale")
    try:
        state = flax.serialization.msgpack_restore(encoded)
    except Exception as error:
        raise ValueError(
            f"cannot decode the bytes for {where}: msgpack says {type(error).__name__}: "
            f"{show(str(error))}. They are truncated or corrupted: restore an intact copy."
        ) from None
    bare = _bare_optimizer_states(target, state)
    if bare:
        raise ValueError(PRE_LOSS_SCALING.format(
            where=f"the bytes hold no loss-scale state at {', '.join(map(repr, bare))}, where "
                  "the target has a with_loss_scaling state"))
    saved_target = as_saved(target, state)  # a ValueError naming fields no version wrote
    try:
        restored = flax.serialization.from_state_dict(saved_target, state)
    except RestoreError:
        raise  # ours, naming the field
    except Exception as error:
        shown = str(error) if isinstance(error, ValueError) else (
            f"{type(error).__name__}: {show(str(error))}")
        raise ValueError(f"cannot restore {where}: the decoded bytes do not match the "
                         f"target's structure ({shown}).") from None
    return upgrade_restored(restored, target)


for _cls in SCALER_TYPES:
    # override=True: re-importing (or reloading) this module must not fail.
    flax.serialization.register_serialization_state(
        _cls, _flax_to_state_dict, _flax_from_state_dict, override=True)
