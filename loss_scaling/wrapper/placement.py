"""Where a wrapper state may sit in an optimizer state: outermost, and nowhere else.

Only the wrapper's ``inner`` sees true gradients and is skipped. A transformation outside
it sees the *scaled* gradients (a clip before it clips every step to a 1/scale-sized
update) or runs on the steps the wrapper skips (a weight decay after it moves the params;
``inject_hyperparams`` around it counts them; a second wrapper after it unscales the
updates again). Every legitimate set-up can put the wrapper outermost
(``ls.with_loss_scaling(optax.chain(clip, adamw(schedule)))``), so wherever the library
sees a set-up, a wrapper inside another transformation is refused. It sees it in two
places:

* the wrapper's own update (plain or fused, eagerly or while traced) reads the frames of
  its callers: run by ``optax.chain`` or ``optax.named_chain`` (at any depth of chains)
  with anything before or after it, it refuses (:func:`refuse_inside_a_chain`);
* wherever the library sees a whole optimizer state (``ls.value_and_grad``,
  ``ls.apply_gradients``, ``ls.TrainState.create``, ``ls.nnx.Optimizer``, the Equinox
  helpers, ``ls.check``, ``ls.metrics``), :func:`refuse_not_outermost` refuses what the
  state alone proves: a wrapper state inside an optax transformation's state
  (``InjectHyperparamsState``, ``MaskedState``, ``ApplyIfFiniteState``,
  ``MultiStepsState``, a ``multi_transform`` group without a wrapper), or in a tuple
  beside an empty state (``()``, ``EmptyState()``: a stateless transformation chained
  before or after it, which no optimizer's state is).

Allowed, because nothing outside the wrapper touches its gradients or its steps:

* containers of complete optimizer states: dicts (an Orbax checkpoint's
  ``{"params": ..., "opt_state": ...}``), lists and tuples (a GAN's two states), a
  NamedTuple of the user's (``TrainState(params, opt_state)``), a flax ``TrainState``, an
  ``nnx.Optimizer`` (already unwrapped by the caller), ``optax.chain(wrapper)`` of one;
* ``optax.multi_transform`` / ``optax.partition`` whose every group is a wrapper (one loss
  scale per loss, a GAN's): each group's gradients reach its own wrapper, masked, and
  nothing else.

What the state alone cannot tell: ``optax.chain(wrapper, adam)``'s state is the tuple
``(wrapper state, adam state)``, exactly a container's; ``optax.named_chain``'s is a dict.
Those are accepted by the state checks and refused by the update, at the first step.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import jax
import optax

from loss_scaling.wrapper.state import LossScalingState, options_of

__all__ = ["misplaced_wrapper_reason", "refuse_inside_a_chain", "refuse_not_outermost",
           "wrapper_states_in"]

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


def _is_empty_state(x: Any) -> bool:
    """``()`` or ``EmptyState()``: a stateless transformation's state, no optimizer's."""
    return isinstance(x, tuple) and len(x) == 0


def _is_optax_state(x: Any) -> bool:
    """A state class of optax's own (a transformation's: a NamedTuple defined in optax)."""
    return (isinstance(x, tuple) and hasattr(x, "_fields")
            and type(x).__module__.split(".")[0] == "optax")


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
    if _is_optax_state(node):  # another transformation around the wrapper
        outer, why = _around(node)
        return _message(outer, path, why)
    children = _children(node)
    if type(node) is tuple:  # optax.chain's state, or a container of the user's
        # Only an empty state beside the wrapper's proves a chain: an optimizer's state
        # holds something. A tuple of complete states (a GAN's) is a container.
        holders = [i for i, (_, child) in enumerate(children) if _holds_wrapper(child)]
        empties = [i for i, (_, child) in enumerate(children) if _is_empty_state(child)]
        if any(i > holders[0] for i in empties):
            return _message("optax.chain", path, WHY_CHAINED_AFTER)
        if any(i < holders[-1] for i in empties):
            return _message("optax.chain", path, WHY_CHAINED_BEFORE)
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


WRAPPER_TWICE = (
    "This optimizer runs `ls.with_loss_scaling(...)` twice, one after the other in {outer} "
    "(the wrapper at {where}): the second unscales the updates of the first again "
    "(divided by the scale twice: every step 1/scale the size it should be) and skips on "
    "its own. Wrap the optimizer once, around the whole of it: "
    "`ls.with_loss_scaling(optax.chain(...))`; for two losses with two scales (a GAN), "
    "give each optimizer its own state and update, or use `optax.multi_transform` with one "
    "wrapper per group (docs/common_mistakes.md, \"Wiring the optimizer\")."
)


def refuse_inside_a_chain() -> None:
    """Raises ``ValueError`` when the wrapper's update, which calls this directly, is run
    by ``optax.chain`` or ``optax.named_chain`` with another transformation before or
    after it (at any depth of chains): the plain ``tx.update`` of an outer chain, and
    :func:`~loss_scaling.apply_gradients` given that chain.

    It reads the callers' frames (optax's chain loop: how many states it has made, which
    update functions it holds), a few attribute reads while tracing or per eager call;
    where optax's code differs it says nothing (a test holds it to the current optax).
    """
    frame: types.FrameType | None = sys._getframe(2)  # the caller of the wrapper's update
    path: list[Any] = []
    try:
        while frame is not None:
            if frame.f_code is _EXTRA_ARGS_CODE:  # optax.with_extra_args_support's shim
                frame = frame.f_back
                continue
            position = _chain_position(frame)
            if position is None:
                return
            outer, key, before, after = position
            path.insert(0, key)
            if any(map(_runs_a_wrapper, before + after)):
                raise ValueError(WRAPPER_TWICE.format(
                    outer=outer, where=f"path {path_str(tuple(path))!r}"))
            if after or before:
                raise ValueError(_message(outer, tuple(path),
                                          WHY_CHAINED_AFTER if after else WHY_CHAINED_BEFORE))
            frame = frame.f_back
    finally:
        del frame  # a frame held here would keep its locals alive


def _stateless() -> optax.GradientTransformation:
    return optax.GradientTransformation(lambda params: (), lambda u, s, p=None: (u, s))


# The code objects of optax's combinators, recognised in a caller's frame.
_CHAIN_CODE = optax.chain(_stateless()).update.__code__
_NAMED_CHAIN_CODE = optax.named_chain(("_", _stateless())).update.__code__
_EXTRA_ARGS_CODE = optax.with_extra_args_support(_stateless()).update.__code__


def _chain_position(frame: Any) -> tuple[str, Any, list[Any], list[Any]] | None:
    """``(outer, key, before, after)`` when ``frame`` is an optax chain's update running
    one of its transformations: the chain's name, that transformation's key in the
    chain's state, and the update functions that run before and after it."""
    code = frame.f_code
    if code is not _CHAIN_CODE and code is not _NAMED_CHAIN_CODE:
        return None
    local = frame.f_locals
    try:
        index = len(local["new_state"])  # the states made so far: this one's position
        if code is _CHAIN_CODE:
            fns = list(local["update_fns"])
            return "optax.chain", jax.tree_util.SequenceKey(index), fns[:index], fns[index + 1:]
        names = [name for name, _ in local["transforms"]]
        fns = [tx.update for _, tx in local["transforms"]]
        return ("optax.named_chain", jax.tree_util.DictKey(names[index]), fns[:index],
                fns[index + 1:])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _closure(fn: Any) -> dict[str, Any]:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    names = getattr(code, "co_freevars", ())
    try:
        return {name: cell.cell_contents for name, cell in zip(names, cells, strict=True)}
    except (ValueError, TypeError):  # an empty cell, or another shape of closure
        return {}


def _runs_a_wrapper(fn: Any, depth: int = 16) -> bool:
    """Whether the update function ``fn`` is a wrapper's, or an optax chain's (or shim's)
    holding one."""
    if options_of(fn) is not None:
        return True
    code = getattr(fn, "__code__", None)
    if depth == 0 or code not in (_CHAIN_CODE, _NAMED_CHAIN_CODE, _EXTRA_ARGS_CODE):
        return False
    closure = _closure(fn)
    inner = (list(closure.get("update_fns", ()))
             + [tx.update for _, tx in closure.get("transforms", ())]
             + ([closure["tx"].update] if "tx" in closure else []))
    return any(_runs_a_wrapper(f, depth - 1) for f in inner)


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
