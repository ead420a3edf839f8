"""Orbax checkpoints that keep the loss scale's configuration and check it on restore:
the state's arrays and :func:`loss_scaling.state_dict` of its loss scale as one plain
``ocp.args.Composite`` (async and multi-host as for any item). README.md says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from loss_scaling._errors import show
from loss_scaling.checkpoint.flax_record import PRE_LOSS_SCALING
from loss_scaling.checkpoint.restore import replace_loss_scale, resolve
from loss_scaling.checkpoint.state_dict import from_state_dict, host_array, state_dict
from loss_scaling.checkpoint.upgrade import target_as_saved, upgrade_restored
from loss_scaling.core import fields
from loss_scaling.core.scalers import LossScale, leaf_names
from loss_scaling.lookup import get_loss_scale

__all__ = ["LOSS_SCALE_ITEM", "STATE_ITEM", "restore", "save_args"]

STATE_ITEM = "state"
"""The Composite item that holds the state's arrays (``ocp.args.StandardSave``)."""
LOSS_SCALE_ITEM = "loss_scale"
"""The Composite item that holds :func:`loss_scaling.state_dict` of its loss scale (JSON)."""


ADOPT_HERE = (
    "To keep the saved loss scale and counters under the target's configuration, pass "
    "`adopt_config=True` to loss_scaling.orbax_restore; to keep the saved configuration, "
    "build the restore target with it."
)
_ROUTE = (
    "restore with the saved configuration{config}, then "
    "`loss_scaling.restore_loss_scale(new_state, loss_scaling.get_loss_scale(restored), "
    "adopt_config=True)` (docs/checkpoints.md, 'Changing the growth rule or the headroom "
    "window')"
)
CANNOT_ADOPT = (
    "loss_scaling.orbax_restore(..., adopt_config=True) cannot adopt {what}: Orbax restores "
    "the loss scale's arrays ({saved}) only into the structure they were saved with, not "
    "the target's ({target}): " + _ROUTE + "."
)
KEEP_STRUCTURE = (
    "{what} changes the loss scale's arrays, so `adopt_config=True` cannot adopt it "
    "through Orbax: " + _ROUTE.format(config="") + ". To keep the saved configuration, "
    "build the restore target with it."
)


def _arrays(scaler: LossScale) -> str:
    """The loss scale's arrays by name and shape: what Orbax restores into."""
    config = getattr(scaler, "config", None)
    return ", ".join(name + "".join(f"[{n}]" for n in fields.shape(name, config))
                     for name in leaf_names(scaler)) or "none"


def _structure_change(saved: LossScale, target: LossScale) -> tuple[str, str] | None:
    """``(what, saved configuration)`` where the saved arrays cannot be restored into the
    target's (another growth rule, another headroom_window); None where they can."""
    saved_config = getattr(saved, "config", None)
    target_config = getattr(target, "config", None)
    if saved_config is None or target_config is None:
        return None
    for name in fields.structure_settings():  # another rule: its window is moot
        saved_value, target_value = getattr(saved_config, name), getattr(target_config, name)
        if saved_value != target_value:
            return (f"{name} ({target_value!r} for the saved {saved_value!r})",
                    f"{name}={saved_value!r}")
    return None


def _resolve(saved: Mapping[str, Any], saved_scaler: LossScale, target: LossScale,
             adopt_config: bool) -> LossScale:
    """:func:`loss_scaling.checkpoint.restore.resolve` with this route's fixes, and
    another array structure refused by name before Orbax meets it."""
    change = _structure_change(saved_scaler, target)
    if change is not None and adopt_config:
        raise ValueError(CANNOT_ADOPT.format(what=change[0], saved=_arrays(saved_scaler),
                                             target=_arrays(target),
                                             config=f" ({change[1]})"))
    fix = ADOPT_HERE if change is None else KEEP_STRUCTURE.format(what=change[0])
    return resolve(saved, target, adopt_config=adopt_config, fix=fix)


def one_replica(scaler: LossScale) -> LossScale:
    """The scaler of a ``pmap``-replicated state (leading device axes) as one scalar
    state; a ValueError if the replicas disagree (a run without ``axis_name``)."""
    leaves, treedef = jax.tree.flatten(scaler)
    single = []
    for name, leaf in zip(leaf_names(scaler), leaves, strict=True):
        host = host_array(leaf)
        own = host.shape[host.ndim - fields.ndim(name):]   # the leaf's own axes, not replicas'
        copies = host.reshape(-1, *own).view(f"u{host.dtype.itemsize}")  # bitwise: NaN == NaN
        if not (copies == copies[0]).all():
            raise ValueError(
                f"the replicas of the loss scale disagree: {name} is {host.tolist()}. Replicas "
                "agree when the wrapper reduces over the devices (axis_name=...).")
        single.append(host.reshape(-1, *own)[0])
    return jax.tree.unflatten(treedef, [np.asarray(x) for x in single])


def _entry(state: Any, path: str | None) -> Any:
    """None when ``get_loss_scale(state, path)`` finds the loss scale, else the key of the
    one entry of the dict ``state`` that holds it (``{"model": ..., "optimizer": ...}``)."""
    try:
        get_loss_scale(state, path)
        return None
    except (ValueError, TypeError) as error:
        if not isinstance(state, Mapping):
            raise
        keys = []
        for key, value in state.items():
            try:
                get_loss_scale(value, path)
                keys.append(key)
            except (ValueError, TypeError):
                pass
        if len(keys) != 1:
            raise error from None
        return keys[0]


def _get(state: Any, key: Any, path: str | None) -> LossScale:
    return get_loss_scale(state if key is None else state[key], path)


def save_args(state: Any, *, path: str | None = None, **items: Any) -> ocp.args.Composite:
    """The ``args`` for ``CheckpointManager.save``: the state and its loss scale's JSON.

    Args:
      state: any pytree holding one loss scale (a ``TrainState``, a ``{"params",
        "opt_state"}`` dict, ``nnx.state(optimizer)`` or a dict holding it), replicated
        or sharded.
      path: which loss scale, as for :func:`loss_scaling.get_loss_scale`.
      **items: more Composite items to save alongside (e.g. a dataset iterator).

    Returns:
      ``ocp.args.Composite(state=StandardSave(state), loss_scale=JsonSave(...), **items)``.

    Raises:
      ValueError: if ``state`` holds no loss scale (or several and ``path`` picks none),
        or its loss scale is invalid or its replicas disagree.

    Examples:
      >>> import tempfile, jax, jax.numpy as jnp, optax
      >>> import orbax.checkpoint as ocp
      >>> import loss_scaling as ls
      >>> def make_state():
      ...     tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(init_scale=256.0))
      ...     return {"params": jnp.ones(2), "opt_state": tx.init(jnp.ones(2))}
      >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as mngr:
      ...     mngr.save(0, args=ls.orbax_save_args(make_state()))
      ...     mngr.wait_until_finished()
      ...     state = ls.orbax_restore(mngr, jax.eval_shape(make_state))
      True
      >>> float(ls.get_loss_scale(state["opt_state"]).loss_scale)
      256.0
    """
    saved = state_dict(one_replica(_get(state, _entry(state, path), path)))
    return ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(state),
                                 LOSS_SCALE_ITEM: ocp.args.JsonSave(saved), **items})


def _values(scaler: LossScale) -> dict[str, Any]:
    return {name: host_array(getattr(scaler, name)) for name in leaf_names(scaler)}


def _saved_items(mngr: ocp.CheckpointManager, step: int) -> list[str] | None:
    """The names of the items saved at ``step`` (``["default"]`` for a single unnamed
    item); None when Orbax cannot say."""
    try:
        metadata = mngr.item_metadata(step)
    except Exception:
        return None
    if any(c.__name__ == "Composite" for c in type(metadata).__mro__):  # named items
        return sorted(k for k in metadata.keys())
    return ["default"]


def _restore_state(mngr: ocp.CheckpointManager, step: int, target: Any) -> Any:
    """The state item restored into ``target``; a checkpoint of an earlier version's
    fields (Orbax refuses another structure) through :func:`target_as_saved` and
    :func:`upgrade_restored`. Today's checkpoints are read once, as before."""
    def read(target: Any) -> Any:
        return mngr.restore(step, args=ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardRestore(target)}))[STATE_ITEM]

    try:
        return read(target)
    except Exception as error:
        failed = error
    try:  # the failed restore told the manager the item's handler: its metadata reads
        metadata = mngr.item_metadata(step)[STATE_ITEM]
    except Exception:
        metadata = None
    saved = target if metadata is None else target_as_saved(target, metadata)
    structure: Any = jax.tree.structure(saved)
    if structure == jax.tree.structure(target):
        raise failed  # the fields are today's: Orbax's error is about something else
    return upgrade_restored(read(saved), target)


def _in_own_dtypes(abstract_state: Any, scaler: LossScale) -> Any:
    """``abstract_state`` with the scaler's leaves asking for their own dtypes (float32,
    int32), whatever the target says (an idiom restores every float leaf in bfloat16), so
    that the arrays compare bit for bit with the JSON. The leaves are found by identity
    (``get_loss_scale`` returns the target's own leaf objects)."""
    wanted = {id(getattr(scaler, name)): fields.dtype(name) for name in leaf_names(scaler)}

    def own_dtype(leaf: Any) -> Any:
        dtype = wanted.get(id(leaf))
        if dtype is None or getattr(leaf, "dtype", None) == dtype:
            return leaf
        return jax.ShapeDtypeStruct(np.shape(leaf), dtype,
                                    sharding=getattr(leaf, "sharding", None))

    return jax.tree.map(own_dtype, abstract_state)


def restore(
    mngr: ocp.CheckpointManager,
    abstract_state: Any,
    *,
    step: int | None = None,
    adopt_config: bool = False,
    path: str | None = None,
) -> Any:
    """Restores a state saved with :func:`save_args`, its loss scale checked.

    A checkpoint written by an earlier version of loss_scaling, whose loss-scaling state
    held other fields, restores too (:func:`loss_scaling.target_as_saved`,
    :func:`loss_scaling.upgrade_restored`); today's checkpoints are read once, as before.

    Args:
      mngr: the ``ocp.CheckpointManager``.
      abstract_state: the restore target, built from scratch on resume
        (``jax.eval_shape(make_state)``, ``nnx.state`` of an abstract optimizer, a
        sharded ``ShapeDtypeStruct`` tree, or a concrete state, whose ``StaticLossScale``
        factor is then compared too). Its configuration is the one the result has.
      step: the step to restore; the latest by default.
      adopt_config: keep the target's configuration when it differs from the saved one
        (:func:`loss_scaling.restore_with_config`). Not for another ``growth`` rule or
        ``headroom_window``, which change the arrays Orbax restores into: restore as
        saved, then :func:`loss_scaling.restore_loss_scale` with ``adopt_config=True``.
      path: which loss scale, as for :func:`loss_scaling.get_loss_scale`.

    Returns:
      The restored state: the target's structure, layout and configuration, the saved
      values.

    Raises:
      ValueError: naming the field, if the configuration differs (unless
        ``adopt_config``), if the saved loss scale is missing or invalid, if the arrays
        disagree with the JSON, or if there is no checkpoint. Orbax's own errors (a
        missing array file) pass through.
    """
    if step is None:
        step = mngr.latest_step()
        if step is None:
            raise ValueError(f"no checkpoint to restore in {mngr.directory}.")
    try:
        saved = mngr.restore(step, args=ocp.args.Composite(
            **{LOSS_SCALE_ITEM: ocp.args.JsonRestore()}))[LOSS_SCALE_ITEM]
    except Exception as error:
        items = _saved_items(mngr, step)
        if items is not None and LOSS_SCALE_ITEM not in items:
            raise ValueError(PRE_LOSS_SCALING.format(
                where=f"the loss-scale item {LOSS_SCALE_ITEM!r} of step {step} is missing "
                      f"from {mngr.directory} (the step's items: "
                      f"{', '.join(map(repr, items))}): it was not saved with "
                      "`loss_scaling.orbax_save_args`")) from None
        raise ValueError(
            f"the loss-scale item {LOSS_SCALE_ITEM!r} of step {step} cannot be read "
            f"({type(error).__name__}: {show(str(error))}): was it saved with "
            "loss_scaling.orbax_save_args, and is the checkpoint intact?") from None
    saved_scaler = from_state_dict(saved)  # validated (a ValueError for a non-dict too)
    # Checked against the target before anything is restored; a concrete target's static
    # factor is compared too (after the restore, the state holds the saved one).
    key = _entry(abstract_state, path)
    new = _resolve(saved, saved_scaler, _get(abstract_state, key, path), adopt_config)
    target = _in_own_dtypes(abstract_state, _get(abstract_state, key, path))
    restored = _restore_state(mngr, step, target)
    arrays = _values(_get(restored, key, path))
    for name, expected in _values(saved_scaler).items():  # float32 / int32, as saved
        got = arrays[name]  # in the saved dtype: _in_own_dtypes asked for it
        if got.dtype != expected.dtype or not (  # every replica, bitwise (NaN == NaN)
                got.view(np.uint32) == expected.view(np.uint32)).all():
            raise ValueError(
                f"the checkpoint of step {step} is corrupted: its arrays say {name} "
                f"{show(got.tolist())}, its loss-scale JSON says "
                f"{expected.tolist()!r}. Restore an intact copy.")
    if key is None:
        return replace_loss_scale(restored, new, path)
    return {**restored, key: replace_loss_scale(restored[key], new, path)}
