"""Checkpoints written by earlier versions: every change to the saved fields of a
loss-scaling state, declared once (:data:`FIELD_CHANGES`), and the two steps that restore
across them: a restore target with the fields as saved (:func:`target_as_saved`), then the
restored state with today's fields (:func:`upgrade_restored`). README.md says why.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.serialization
import jax
import numpy as np

from loss_scaling._errors import show
from loss_scaling.checkpoint import record
from loss_scaling.checkpoint.state_dict import host_array, place_like
from loss_scaling.core import fields
from loss_scaling.core.scalers import DynamicLossScale, dynamic_from_leaves, leaf_names
from loss_scaling.wrapper.state import LossScalingState, is_state_mapping

__all__ = ["FIELD_CHANGES", "FieldAdded", "FieldRemoved", "target_as_saved",
           "upgrade_restored"]


class FieldAdded(NamedTuple):
    """A field a state gained: a checkpoint written before has none, and restores it as
    ``value``, placed in the layout of the field ``like`` (its replica axes, sharding).

    Attributes:
      node: the state that gained it: ``"LossScalingState"`` or ``"DynamicLossScale"``.
      name: the field.
      like: a field of the same state with the same shape and layout.
      value: what a checkpoint without the field restores it as (in ``dtype``).
      dtype: its dtype.
      since: the change that added it.
      why: why ``value`` loses nothing (docs/checkpoints.md shows it).
    """

    node: str
    name: str
    like: str
    value: Any
    dtype: str
    since: str
    why: str


class FieldRemoved(NamedTuple):
    """A field a state lost: a checkpoint written before holds it. It is read, checked
    against what the other fields say it must be, and dropped.

    Attributes:
      node: the state that lost it: ``"LossScalingState"`` or ``"DynamicLossScale"``.
      name: the field.
      like: a field of the same state with the same shape and layout.
      dtype: its saved dtype.
      derived: ``fields -> value``: from the restored state's other fields (host arrays by
        name), or with ``holder`` the fields of the state that holds it, what the field
        must hold. A saved value that differs is refused: the checkpoint is
        inconsistent, and dropping the field would hide it.
      since: the change that removed it.
      why: why dropping it loses nothing.
      holder: ``None``, or the state whose fields ``derived`` reads: the one that holds
        this state (``"LossScalingState"`` for its ``scaler``). Where no such state holds
        it, the field must hold 0 (dropping it loses nothing).
    """

    node: str
    name: str
    like: str
    dtype: str
    derived: Callable[[Mapping[str, np.ndarray]], Any]
    since: str
    why: str
    holder: str | None = None


def _last_step_applied(fields: Mapping[str, np.ndarray]) -> Any:
    return fields["consecutive_skips"] == 0


def _wrapper_failure(wrapper: Mapping[str, np.ndarray]) -> Any:
    return wrapper["failure"]


FIELD_CHANGES: tuple[FieldAdded | FieldRemoved, ...] = (
    FieldRemoved(
        "LossScalingState", "last_step_finite", like="consecutive_skips", dtype="bool",
        derived=_last_step_applied, since="issue 34 (written by 250089d and before)",
        why="it said whether the last step was applied, which `consecutive_skips == 0` "
            "says (the property `last_step_applied`)"),
    FieldAdded(
        "LossScalingState", "consecutive_nonfinite_losses", like="nonfinite_loss_steps",
        value=0, dtype="int32", since="issue 42",
        why="a streak of non-finite losses is not carried over: `max_nonfinite_losses` "
            "counts from the restore on"),
    FieldRemoved(
        "DynamicLossScale", "failure", like="growth_tracker", dtype="int32",
        derived=_wrapper_failure, holder="LossScalingState", since="issue 41",
        why="a with_loss_scaling state's `failure` is the one register: its scaler's was "
            "a copy of it, written every step (a scaler on its own keeps its own)"),
)
"""Every change of the fields a checkpoint holds, oldest first. A change is one entry here
(and a fixture folder written by the version that makes it, tests/fixtures/checkpoints/).
An entry whose field the state does not have (yet) is never used."""


# ------------------------------------------------------------------ the states' fields


def _is_scaler_mapping(node: Any) -> bool:
    """A dynamic scaler as an ``nnx.State`` holds it: a mapping of its leaves."""
    return isinstance(node, Mapping) and (
        {"loss_scale", "growth_tracker"} <= set(node) <= set(fields.ALL_DYNAMIC_LEAF_NAMES))


def _fields(node: Any) -> list[str]:
    """A state's fields: a mapping's keys, a scaler's leaves, a NamedTuple's fields."""
    if isinstance(node, Mapping):
        return list(node)
    if isinstance(node, DynamicLossScale):
        return list(leaf_names(node))
    return list(node._fields)


class _Kind(NamedTuple):
    """One kind of state: how it is found in a target, and built from its fields."""

    name: str
    is_node: Callable[[Any], bool]
    build: Callable[[Any, dict[str, Any]], Any]  # (target node, values by name)

    def rebuild(self, target: Any, values: dict[str, Any]) -> Any:
        """A node of ``target``'s type and fields holding ``values`` (an ``nnx.State``
        mapping keeps its type)."""
        if isinstance(target, Mapping):
            mapping_type: Any = type(target)
            return mapping_type({name: values[name] for name in target})
        return self.build(target, values)


_WRAPPER = _Kind("LossScalingState",
                 lambda x: isinstance(x, LossScalingState) or is_state_mapping(x),
                 lambda target, values: LossScalingState(**values))
_SCALER = _Kind("DynamicLossScale",
                lambda x: isinstance(x, DynamicLossScale) or _is_scaler_mapping(x),
                lambda target, values: dynamic_from_leaves(
                    target.config, tuple(values[name] for name in leaf_names(target))))
_KINDS = (_WRAPPER, _SCALER)  # holders before what they hold


@functools.cache
def _saved_type(kind: str, fields: tuple[str, ...]) -> type:
    """A NamedTuple with the saved fields: the restore target of one saved state (Orbax and
    flax restore NamedTuples by field name, whatever the class)."""
    return collections.namedtuple(f"Saved{kind}", fields)


# ------------------------------------------------------------ the saved tree, by path


def _key(key: Any) -> Any:
    """One step of a jax key path as a saved tree names it."""
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return getattr(key, attribute)
    return key


def saved_at(saved: Any, path: Sequence[Any]) -> Any:
    """The node of a saved tree (a decoded flax state dict, Orbax's metadata tree) at the
    key path of a target's node; None where the saved tree has none."""
    node = saved
    for key in map(_key, path):
        if isinstance(node, Mapping):
            node = node.get(key, node.get(str(key)))
        elif isinstance(node, (list, tuple)) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return None
    return node


NO_METADATA = (
    "target_as_saved got `saved=None`: Orbax returns no metadata for an item whose "
    "handler the CheckpointManager does not know yet. Build the manager with it, e.g. "
    "`ocp.CheckpointManager(directory, item_handlers=ocp.StandardCheckpointHandler())` "
    "(for a checkpoint saved with `ls.orbax_save_args`: `item_handlers={'state': "
    "ocp.StandardCheckpointHandler(), 'loss_scale': ocp.JsonCheckpointHandler()}` and "
    "`mngr.item_metadata(step)['state']`)."
)


def _saved_tree(saved: Any) -> Any:
    """The nested saved structure: bytes decoded by flax's msgpack, an Orbax metadata
    object by its ``tree``."""
    if saved is None:
        raise ValueError(NO_METADATA)
    if isinstance(saved, (bytes, bytearray, memoryview)):
        return flax.serialization.msgpack_restore(bytes(saved))
    return getattr(saved, "tree", saved)


# -------------------------------------------------------------------- the two steps


UNKNOWN_FIELDS = (
    "the checkpoint's loss-scale state ({kind}) at {path!r} holds {fields}, which neither "
    "this version of loss_scaling nor an earlier one wrote (the earlier fields it reads: "
    "{known}). Was it written by a newer version, or is it corrupted? Restore it with the "
    "version that wrote it, or restore an intact copy."
)
MISSING_FIELDS = (
    "the checkpoint's loss-scale state ({kind}) at {path!r} lacks {fields}, which every "
    "version of loss_scaling wrote: it is corrupted, or not a checkpoint of this state."
)
INCONSISTENT_FIELD = (
    "the checkpoint's loss-scale state ({kind}) at {path!r} holds {name}={saved}, but its "
    "other fields say {expected} ({why}): the checkpoint is inconsistent (edited or "
    "corrupted), and dropping {name} would hide that. Restore an intact copy."
)
NOT_AN_ARRAY = (
    "the checkpoint's loss-scale state ({kind}) at {path!r} holds {name}={value}, not an "
    "array: the checkpoint is corrupted. Restore an intact copy."
)
TRACED_FIELD = (
    "upgrade_restored checks the saved {name} of the loss-scale state ({kind}) at {path!r} "
    "against its other fields, so it needs concrete arrays, got a tracer: call it outside "
    "jit, on the restored state."
)


def _pathname(path: Sequence[Any]) -> str:
    return "./" + jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def _changes(kind: str, changes: Sequence[FieldAdded | FieldRemoved],
             ) -> tuple[dict[str, FieldAdded], dict[str, FieldRemoved]]:
    added = {c.name: c for c in changes if isinstance(c, FieldAdded) and c.node == kind}
    removed = {c.name: c for c in changes if isinstance(c, FieldRemoved) and c.node == kind}
    return added, removed


def _difference(kind: str, target_fields: Sequence[str], saved_fields: Sequence[str],
                path: Sequence[Any], changes: Sequence[FieldAdded | FieldRemoved],
                ) -> tuple[list[FieldAdded], list[FieldRemoved]]:
    """The declared changes between a saved state's fields and the target's; a ValueError
    for a difference no change declares."""
    added, removed = _changes(kind, changes)
    extra = [name for name in saved_fields if name not in target_fields]
    missing = [name for name in target_fields if name not in saved_fields]
    unknown = [name for name in extra if name not in removed]
    if unknown:
        raise ValueError(UNKNOWN_FIELDS.format(
            kind=kind, path=_pathname(path), fields=", ".join(map(show, unknown)),
            known=", ".join(removed) or "none"))
    unexplained = [name for name in missing if name not in added]
    if unexplained:
        raise ValueError(MISSING_FIELDS.format(kind=kind, path=_pathname(path),
                                               fields=", ".join(unexplained)))
    return [added[name] for name in missing], [removed[name] for name in extra]


def _placeholder(like: Any, dtype: str) -> Any:
    """A restore target leaf (or ``nnx.Variable``) for a removed field: ``like``'s shape
    and sharding, the field's saved dtype."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        np.shape(x), np.dtype(dtype), sharding=getattr(x, "sharding", None)), like)


def target_as_saved(target: Any, saved: Any, *,
                    changes: Sequence[FieldAdded | FieldRemoved] = FIELD_CHANGES) -> Any:
    """The restore target with each loss-scaling state's fields as a checkpoint holds them.

    A checkpoint written by an earlier version of loss_scaling can hold other fields than
    today's state (:data:`FIELD_CHANGES`): Orbax and flax restore only into the structure
    they saved. Restore into this target, then pass the result to
    :func:`upgrade_restored`. ``ls.orbax_restore`` and ``ls.from_bytes`` do both steps
    themselves; these two are for a restore through Orbax's or flax's own API.

    Args:
      target: the restore target, built by today's code (abstract or concrete, of any
        structure: a dict, a ``TrainState``, ``nnx.state`` of an optimizer).
      saved: what the checkpoint says of its structure: ``mngr.item_metadata(step)``
        (for a checkpoint saved with ``ls.orbax_save_args``, its ``["state"]``), the
        ``flax.serialization`` bytes, or a decoded state dict.

    Returns:
      ``target`` where each saved loss-scaling state differs from today's, with that
      state as a NamedTuple (or, in an ``nnx.State``, a mapping) of the saved fields:
      a removed field is a placeholder of its saved dtype, an added one is left out.
      Every other node is ``target``'s own.

    Raises:
      ValueError: naming the state and the fields, where the saved fields differ in a way
        no earlier version wrote (a newer version's checkpoint, or not a checkpoint of
        this state).

    Examples:
      >>> import flax.serialization, jax.numpy as jnp, optax
      >>> import loss_scaling as ls
      >>> tx = ls.with_loss_scaling(optax.sgd(0.1))
      >>> state = {"params": jnp.ones(2), "opt_state": tx.init(jnp.ones(2))}
      >>> data = flax.serialization.to_bytes(state)  # today's fields: the target as it is
      >>> type(ls.target_as_saved(state, data)["opt_state"]).__name__
      'LossScalingState'
    """
    return as_saved(target, _saved_tree(saved), changes)


def as_saved(target: Any, tree: Any,
             changes: Sequence[FieldAdded | FieldRemoved] = FIELD_CHANGES) -> Any:
    """:func:`target_as_saved` given the saved tree itself (a decoded flax state dict,
    whose top may be a scaler's record bytes, or Orbax's metadata tree)."""
    for kind in _KINDS:
        def convert(path: Sequence[Any], node: Any, kind: _Kind = kind) -> Any:
            if not kind.is_node(node):
                return node
            saved_node = saved_at(tree, path)
            in_record = record.saved_leaf_names(saved_node)  # a scaler's flax record
            if not isinstance(saved_node, Mapping) and in_record is None:
                return node  # nothing to compare
            saved_fields = list(saved_node) if in_record is None else list(in_record)
            fields = _fields(node)
            try:
                added, removed = _difference(kind.name, fields, saved_fields, path, changes)
            except ValueError:
                if in_record is None:
                    raise
                return node  # another rule's record: reading it says so (flax_record)
            if not added and not removed:
                return node
            values = {name: node[name] if isinstance(node, Mapping) else getattr(node, name)
                      for name in fields if name not in {c.name for c in added}}
            for change in removed:
                values[change.name] = _placeholder(values[change.like], change.dtype)
            if in_record is not None:  # flax reads a record into a scaler, its leaves those
                return dynamic_from_leaves(node.config, [values[n] for n in in_record])
            if isinstance(node, Mapping):
                mapping_type: Any = type(node)
                return mapping_type(values)
            return _saved_type(kind.name, tuple(values))(**values)

        target = jax.tree_util.tree_map_with_path(convert, target, is_leaf=kind.is_node)
    return target


def _value(node: Any, name: str) -> Any:
    return node[name] if isinstance(node, Mapping) else getattr(node, name)


def _host(leaf: Any, name: str, kind: str, path: Sequence[Any]) -> np.ndarray:
    """A field's value on the host (an ``nnx.Variable``'s too)."""
    values = jax.tree.leaves(leaf)
    if any(isinstance(value, jax.core.Tracer) for value in values):
        raise ValueError(TRACED_FIELD.format(name=name, kind=kind, path=_pathname(path)))
    if len(values) != 1:
        raise ValueError(NOT_AN_ARRAY.format(name=name, kind=kind, path=_pathname(path),
                                             value=show(leaf)))
    return host_array(values[0])


class _OnHost(Mapping[str, np.ndarray]):
    """A restored state's fields, each read onto the host when a check asks for it."""

    def __init__(self, values: dict[str, Any], kind: str, path: Sequence[Any]) -> None:
        self._values, self._kind, self._path = values, kind, path

    def __getitem__(self, name: str) -> np.ndarray:
        return _host(self._values[name], name, self._kind, self._path)

    def __iter__(self) -> Any:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def upgrade_restored(restored: Any, target: Any, *,
                     changes: Sequence[FieldAdded | FieldRemoved] = FIELD_CHANGES) -> Any:
    """A state restored into :func:`target_as_saved`'s target, with today's fields.

    A removed field is checked against the fields that now say the same (a checkpoint
    whose copies disagree is refused) and dropped; an added field gets the value its
    :class:`FieldAdded` declares, in the layout of the field it is ``like``. Nothing else
    changes: every other leaf is the restored one.

    Args:
      restored: what Orbax or flax restored into ``target_as_saved(target, ...)``.
      target: the target given to :func:`target_as_saved`.

    Returns:
      ``restored`` with each loss-scaling state of ``target``'s type and fields (a state
      that was saved with today's fields is returned as restored).

    Raises:
      ValueError: naming the state and the field, if a removed field disagrees with the
        fields that replace it, or (inside ``jit``) if one must be checked.

    Examples:
      >>> import flax.serialization, jax.numpy as jnp, optax
      >>> import loss_scaling as ls
      >>> tx = ls.with_loss_scaling(optax.sgd(0.1))
      >>> state = {"params": jnp.ones(2), "opt_state": tx.init(jnp.ones(2))}
      >>> data = flax.serialization.to_bytes(state)
      >>> saved_target = ls.target_as_saved(state, data)
      >>> restored = flax.serialization.from_bytes(saved_target, data)
      >>> int(ls.upgrade_restored(restored, state)["opt_state"].skipped_steps)
      0
    """
    def upgrade(kind: _Kind, path: Sequence[Any], target_node: Any, node: Any,
                holder: Mapping[str, np.ndarray] | None) -> Any:
        fields = _fields(target_node)
        if fields == _fields(node) and (type(node) is type(target_node)
                                        or isinstance(node, Mapping)):
            return node  # saved with today's fields
        added, removed = _difference(kind.name, fields, _fields(node), path, changes)
        if not added and not removed:
            return node
        values = {name: _value(node, name) for name in _fields(node)}
        for gone in removed:  # each against the restored fields as saved
            saved = _host(values[gone.name], gone.name, kind.name, path)
            if gone.holder is None:
                others = {k: v for k, v in values.items() if k != gone.name}
                expected = np.asarray(gone.derived(_OnHost(others, kind.name, path)))
            elif holder is None:  # nothing holds it: only a value that says nothing drops
                expected = np.zeros_like(saved)
            else:
                expected = np.asarray(gone.derived(holder))
            if saved.dtype != expected.dtype or not np.array_equal(saved, expected):
                raise ValueError(INCONSISTENT_FIELD.format(
                    kind=kind.name, path=_pathname(path), name=gone.name,
                    saved=show(saved.tolist()), expected=show(expected.tolist()),
                    why=gone.why))
        for gone in removed:
            del values[gone.name]
        for new in added:
            value = np.asarray(new.value, np.dtype(new.dtype))
            values[new.name] = jax.tree.map(
                lambda like, value=value: place_like(value, like), values[new.like])
        return kind.rebuild(target_node, values)

    def wrapper(path: Sequence[Any], target_node: Any, node: Any) -> Any:
        """A wrapper state, then its scaler checked against its fields."""
        if not _WRAPPER.is_node(target_node):
            return node
        node = upgrade(_WRAPPER, path, target_node, node, None)
        scaler_target = _value(target_node, "scaler") if "scaler" in _fields(
            target_node) else None
        if scaler_target is None or not _SCALER.is_node(scaler_target):
            return node
        scaler_path = (*path, jax.tree_util.GetAttrKey("scaler"))
        scaler = upgrade(_SCALER, scaler_path, scaler_target, _value(node, "scaler"),
                         _OnHost({n: _value(node, n) for n in _fields(node)},
                                 _WRAPPER.name, path))
        if isinstance(node, Mapping):
            mapping_type: Any = type(node)
            return mapping_type({**node, "scaler": scaler})
        return node._replace(scaler=scaler)

    def alone(path: Sequence[Any], target_node: Any, node: Any) -> Any:
        """A scaler no wrapper holds (those a wrapper holds match their target by now)."""
        return upgrade(_SCALER, path, target_node, node, None) if _SCALER.is_node(
            target_node) else node

    restored = jax.tree_util.tree_map_with_path(wrapper, target, restored,
                                                is_leaf=_WRAPPER.is_node)
    return jax.tree_util.tree_map_with_path(alone, target, restored, is_leaf=_SCALER.is_node)
