"""Where a wrapper state may sit in an optimizer state: outermost, and nowhere else.

Only the wrapper's ``inner`` sees true gradients and is skipped. A transformation outside
it sees the *scaled* gradients (a clip before it clips every step to a 1/scale-sized
update) or runs on the steps the wrapper skips (a weight decay after it moves the params;
``inject_hyperparams`` around it counts them). Every legitimate set-up can put the wrapper
outermost (``ls.with_loss_scaling(optax.chain(clip, adamw(schedule)))``), so wherever the
library sees a whole optimizer state (``ls.value_and_grad``, ``ls.apply_gradients``,
``ls.TrainState.create``, ``ls.nnx.Optimizer``, the Equinox helpers, ``ls.check``,
``ls.metrics``), a wrapper state inside another transformation's state is refused.

Allowed, because nothing outside the wrapper touches its gradients or its steps:

* containers that are no optax transformation: dicts (an Orbax checkpoint's
  ``{"params": ..., "opt_state": ...}``), a flax ``TrainState``, an ``nnx.Optimizer``
  (already unwrapped by the caller), a tuple or list whose other elements hold no optax
  state (``optax.chain(wrapper)`` of one);
* ``optax.multi_transform`` / ``optax.partition`` whose every group is a wrapper (one loss
  scale per loss, a GAN's): each group's gradients reach its own wrapper, masked, and
  nothing else.

What cannot be told from a state: ``optax.named_chain`` (its state is a dict, as a
checkpoint's container is), and the plain ``tx.update`` of a wrapper inside an outer
``optax.chain`` (the wrapper's update sees only its own state).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from loss_scaling.wrapper.state import LossScalingState

__all__ = ["misplaced_wrapper_reason", "refuse_not_outermost", "wrapper_states_in"]

WRAPPER_NOT_OUTERMOST = (
    "This optimizer state holds `ls.with_loss_scaling(...)` inside another transformation "
    "({outer}, at {where}): {why} Put the wrapper outermost, around the whole optimizer: "
    "`ls.with_loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), "
    "optax.adamw(schedule)))` (docs/common_mistakes.md, \"Wiring the optimizer\")."
)
WHY_CHAINED_BEFORE = (
    "a transformation chained before it (e.g. optax.clip_by_global_norm) sees the scaled "
    "gradients, so a clip cuts every step to a 1/scale-sized update and training stalls."
)
WHY_CHAINED_AFTER = (
    "a transformation chained after it (e.g. optax.add_decayed_weights) also runs on the "
    "steps the wrapper skips, so the params move on a skipped step."
)
WHY_INJECT = (
    "optax.inject_hyperparams (or a schedule) around it counts the skipped steps as steps, "
    "and sees the scaled gradients."
)
WHY_MASKED = (
    "optax.masked passes the gradients of the masked-out leaves through still scaled "
    "(32768x at the default scale) and unchecked."
)
WHY_OTHER = "{name} sees the scaled gradients and runs on the steps the wrapper skips."
WHY_GROUP_WITHOUT_WRAPPER = (
    "its group {label!r} has no wrapper of its own, so that group's optimizer receives the "
    "scaled gradients and runs on skipped steps. Give every group its own wrapper (one loss "
    "scale per loss), or"
)


def refuse_not_outermost(opt_state: Any) -> None:
    """Raises ``ValueError`` if a wrapper state is not outermost in ``opt_state``.

    ``opt_state`` is a pure pytree (framework containers already unwrapped). The
    ``MultiSteps`` refusal comes first, with its own message.
    """
    refuse_wrapper_inside_multisteps(opt_state)
    reason = misplaced_wrapper_reason(opt_state)
    if reason is not None:
        raise ValueError(reason)


def misplaced_wrapper_reason(opt_state: Any) -> str | None:
    """The message for the first wrapper state that is not outermost, else ``None``."""
    if isinstance(opt_state, LossScalingState) or not _holds_wrapper(opt_state):
        return None  # the common case, in O(1) or one flatten
    return _walk(opt_state, ())


def _is_wrapper(x: Any) -> bool:
    return isinstance(x, LossScalingState)


def _holds_wrapper(tree: Any) -> bool:
    return any(map(_is_wrapper, jax.tree.leaves(tree, is_leaf=_is_wrapper)))


def _holds_optax_state(tree: Any) -> bool:
    """Whether ``tree`` holds an optax-like state (a NamedTuple such as ``EmptyState``)."""
    def named(x: Any) -> bool:
        return isinstance(x, tuple) and hasattr(x, "_fields")
    return any(map(named, jax.tree.leaves(tree, is_leaf=named)))


def _message(outer: str, path: tuple[Any, ...], why: str) -> str:
    where = f"path {path_str(path)!r}" if path else "the top of the state"
    return WRAPPER_NOT_OUTERMOST.format(outer=outer, where=where, why=why)


def _children(node: Any) -> list[tuple[Any, Any]]:
    """``(key, child)`` one level down, for any pytree node."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    return [(path[0], child) for path, child in pairs if path]


def _walk(node: Any, path: tuple[Any, ...]) -> str | None:
    if _is_wrapper(node) or not _holds_wrapper(node):
        return None
    if isinstance(node, optax.MultiTransformState):
        return _walk_groups(node, path)
    if isinstance(node, tuple) and hasattr(node, "_fields"):  # another transformation
        outer, why = _around(node)
        return _message(outer, path, why)
    children = _children(node)
    if isinstance(node, (tuple, list)):  # optax.chain, or a container of the user's
        holders = [i for i, (_, child) in enumerate(children) if _holds_wrapper(child)]
        first, last = holders[0], holders[-1]
        before = any(_holds_optax_state(c) for _, c in children[:first])
        after = any(_holds_optax_state(c) for _, c in children[last + 1:])
        if before or after:
            return _message("optax.chain", path,
                            WHY_CHAINED_BEFORE if before else WHY_CHAINED_AFTER)
    for key, child in children:
        reason = _walk(child, (*path, key))
        if reason is not None:
            return reason
    return None


def _around(node: Any) -> tuple[str, str]:
    """The transformation whose state ``node`` is, and what it does wrong outside."""
    if isinstance(node, (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)):
        return "optax.inject_hyperparams", WHY_INJECT
    if isinstance(node, optax.MaskedState):
        return "optax.masked", WHY_MASKED
    name = type(node).__name__
    return name, WHY_OTHER.format(name=f"The transformation of its {name}")


def _walk_groups(node: Any, path: tuple[Any, ...]) -> str | None:
    """``multi_transform`` with a wrapper per group is allowed; a group without one is not."""
    groups_path = (*path, jax.tree_util.GetAttrKey("inner_states"))
    for label, group in node.inner_states.items():
        inner = group.inner_state if isinstance(group, optax.MaskedState) else group
        if _is_wrapper(inner):
            continue
        if _holds_wrapper(inner):
            reason = _walk(inner, (*groups_path, jax.tree_util.DictKey(label)))
            if reason is not None:
                return reason
            continue
        why = WHY_GROUP_WITHOUT_WRAPPER.format(label=label)
        return _message("optax.multi_transform", path, why).replace(
            f"{why} Put the wrapper outermost", f"{why} put the wrapper outermost")
    return None


WRAPPER_INSIDE_MULTISTEPS = (
    "This optimizer state holds `ls.with_loss_scaling(...)` inside `optax.MultiSteps` "
    "({where}): that order trains nothing after the first overflow (MultiSteps resets its "
    "accumulator as (1 - emit) * acc, and 0 * inf is NaN). Put the wrapper around the "
    "accumulation, `ls.with_loss_scaling(optax.MultiSteps(inner, every_k_schedule=k))`, which "
    "checks each micro batch (docs/optax_wrapper.md, \"Gradient accumulation\")."
)


def wrapper_states_in(opt_state: Any) -> list[tuple[str, LossScalingState]]:
    """Every wrapper state inside an optax state, with its key path (``path_str``)."""
    # optax matches a NamedTuple by its class name; the isinstance filter rules out
    # any other class that happens to share the name.
    found = optax.tree_utils.tree_get_all_with_path(
        opt_state, LossScalingState.__name__,
        filtering=lambda _, value: isinstance(value, LossScalingState))
    return [(path_str(path), value) for path, value in found]


def refuse_wrapper_inside_multisteps(opt_state: Any) -> None:
    """Raises ``ValueError`` if a wrapper state sits inside an ``optax.MultiStepsState``."""
    if not _multisteps_around_a_wrapper(opt_state):
        return
    found = optax.tree_utils.tree_get_all_with_path(
        opt_state, optax.MultiStepsState.__name__,
        filtering=lambda _, value: isinstance(value, optax.MultiStepsState))
    for path, state in found:
        if wrapper_states_in(state.inner_opt_state):
            where = path_str(path)
            raise ValueError(WRAPPER_INSIDE_MULTISTEPS.format(
                where=f"the MultiStepsState at path {where!r}" if where
                else "the MultiStepsState is the whole state"))


def _multisteps_around_a_wrapper(tree: Any) -> bool:
    """The common answer, no, without key paths: it stops at the outermost states (an
    eager `ls.value_and_grad` pays this on every call, 7 ms for 1,000 leaves with paths)."""
    for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(
            x, (optax.MultiStepsState, LossScalingState))):
        if isinstance(x, optax.MultiStepsState):
            if _holds_wrapper(x.inner_opt_state):
                return True
            inner = x.inner_opt_state
        elif _is_wrapper(x):
            inner = x.inner_state
        else:
            continue
        if _multisteps_around_a_wrapper(inner):
            return True
    return False


def path_str(path: tuple[Any, ...]) -> str:
    """A key path as Python would index it, e.g. ``.inner_states['x'].inner_state``
    (``keystr``, but an optax ``NamedTupleKey`` without its tuple's name)."""
    return "".join(f".{key.name}" if isinstance(key, optax.tree_utils.NamedTupleKey)
                   else jax.tree_util.keystr((key,)) for key in path)
