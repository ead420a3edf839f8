"""flax ``nnx``: gradients of the scaled loss, and a fused ``nnx.Optimizer`` (README.md).

Reached as ``loss_scaling.nnx``, imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
from flax import nnx
from flax.nnx.transforms import general  # split_inputs / merge_inputs: nnx.jit's lifting

from loss_scaling import _registry
from loss_scaling._errors import show
from loss_scaling.core import fields
from loss_scaling.core.scalers import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    dynamic_from_leaves,
    without_failure,
)
from loss_scaling.core.tree import any_leaf
from loss_scaling.grad import WRONG_FIRST_ARGUMENT, argnums_within, scaled_loss, scaler_of_state
from loss_scaling.lookup import get_loss_scale, refuse_misplaced_wrapper, wrapper_state
from loss_scaling.wrapper import provenance
from loss_scaling.wrapper.placement import wrapper_states_in
from loss_scaling.wrapper.state import (
    LossScalingState,
    UnderflowStats,
    carried_failure,
    is_state_mapping,
)
from loss_scaling.wrapper.transform import apply_gradients

__all__ = ["Optimizer", "value_and_grad"]

CONFIG_METADATA = "loss_scale_config"  # Variable metadata set by Optimizer

CALLER = provenance.Caller(
    call="optimizer.update(model, grads)", grad="`nnx.grad`",
    recipe="ls.value_and_grad(loss_fn)(optimizer, model, batch)")
"""How the trace-time messages name ``Optimizer.update`` and its recipe."""


def is_graph_node(x: Any) -> bool:
    """Whether ``x`` is an ``nnx`` graph node (a Module, an Optimizer) or Variable."""
    return isinstance(x, nnx.Variable) or nnx.graph.is_graph_node(x)


def scaler_of(state: Any) -> Any:
    """The loss scale held by ``state``, or an error saying what the first argument must be."""
    if isinstance(state, nnx.Variable):
        hint = " (a Variable: did you forget the optimizer?)"
    elif nnx.graph.is_graph_node(state) and not isinstance(state, nnx.Optimizer):
        hint = " (an nnx graph node that is not an optimizer: did you pass the model first?)"
    else:
        return scaler_of_state(state)
    raise TypeError(WRONG_FIRST_ARGUMENT.format(what=show(state, type_only=True), hint=hint))


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    wrt: Any = None,
) -> Callable[..., Any]:
    """``nnx.value_and_grad`` of the scaled loss: unscaled loss (and aux), scaled grads.

    The returned function takes the loss scale's holder first (an ``nnx.Optimizer``, or
    anything :func:`~loss_scaling.get_loss_scale` accepts), then ``fun``'s arguments.
    Module arguments at ``argnums`` are differentiated with respect to ``wrt`` (by
    default the optimizer's own filter, else ``nnx.Param``); their other state (RNG
    streams, BatchNorm statistics) is updated in place, as ``nnx.value_and_grad`` does.

    Args:
      fun: the loss function; returns a scalar loss (or ``(loss, aux)``).
      argnums: which of ``fun``'s arguments to differentiate, as in ``nnx.value_and_grad``.
      has_aux: as in ``nnx.value_and_grad``.
      wrt: an ``nnx`` filter overriding the default described above.

    Returns:
      ``f(optimizer, *args, **kwargs) -> (loss, grads)`` or ``((loss, aux), grads)``, the
      grads as ``nnx.value_and_grad`` returns them (an ``nnx.State`` per Module argument)
      and scaled by the current loss scale.

    Raises:
      TypeError: at call time, if the first argument is a Module or an array (the loss
        scale's holder must come first); ValueError if it holds no loss scale.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import loss_scaling as ls
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> tx = ls.with_loss_scaling(optax.sgd(0.1), ls.StaticLossScale(8.0))
      >>> optimizer = ls.nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> loss_fn = lambda model, x: jnp.sum(model(x) ** 2)
      >>> x = jnp.ones((1, 2))
      >>> loss, grads = ls.value_and_grad(loss_fn)(optimizer, model, x)
      >>> _, true_grads = nnx.value_and_grad(loss_fn)(model, x)
      >>> bool(jnp.all(grads["kernel"][...] == 8 * true_grads["kernel"][...]))
      True
      >>> ls.value_and_grad(loss_fn)(model, optimizer, x)
      Traceback (most recent call last):
      ...
      TypeError: The function returned by `loss_scaling.value_and_grad(loss_fn)` takes ...
    """
    def wrapped(state: Any, *args: Any, **kwargs: Any) -> Any:
        scaler = scaler_of(state)
        filter_ = wrt if wrt is not None else (
            state.wrt if isinstance(state, nnx.Optimizer) else nnx.Param)
        nnx_argnums = tuple(nnx.DiffState(i, filter_) if is_graph_node(args[i]) else i
                            for i in argnums_within(argnums, args, "optimizer"))

        def scaled(*args: Any, **kwargs: Any) -> Any:
            return scaled_loss(fun, has_aux, scaler, *args, **kwargs)

        grad_fn = nnx.value_and_grad(
            scaled, argnums=nnx_argnums[0] if isinstance(argnums, int) else nnx_argnums,
            has_aux=True)
        (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return wrapped


class Optimizer(nnx.Optimizer):
    """``flax.nnx.Optimizer`` with the fused loss-scaled step.

    Build it with ``tx=with_loss_scaling(...)`` and pass the gradients of the *scaled*
    loss (:func:`loss_scaling.value_and_grad`). ``update`` runs the inner update and its
    application to the model under one skip decision (:func:`loss_scaling.apply_gradients`):
    a skipped step leaves the ``wrt`` variables and ``opt_state`` bit-identical; ``step``
    counts every call. The scaler's configuration is also kept as metadata of its
    variables, so that ``get_loss_scale``, ``metrics`` and ``restore_loss_scale`` work on
    ``nnx.state(optimizer)`` (an Orbax restore target) as on the optimizer.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import loss_scaling as ls
      >>> model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
      >>> tx = ls.with_loss_scaling(optax.sgd(0.5), ls.DynamicLossScale(init_scale=4.0))
      >>> optimizer = ls.nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> loss, grads = ls.value_and_grad(lambda m: jnp.sum(m.kernel[...]))(optimizer, model)
      >>> before = model.kernel[...]
      >>> optimizer.update(model, grads)                     # grads are scaled by 4
      >>> bool(jnp.all(model.kernel[...] == before - 0.5)), int(optimizer.step)
      (True, 1)
      >>> bad = jax.tree.map(lambda g: g * jnp.inf, grads)
      >>> optimizer.update(model, bad)                       # skipped, scale backed off
      >>> bool(jnp.all(model.kernel[...] == before - 0.5))
      True
      >>> float(ls.get_loss_scale(optimizer).loss_scale)
      2.0
    """

    def __init__(self, model: Any, tx: Any, *, wrt: Any, graph: bool | None = None) -> None:
        super().__init__(model, tx, wrt=wrt, graph=graph)
        refuse_misplaced_wrapper(self.opt_state)
        for _, state in wrapper_states_in(self.opt_state):  # holding nnx Variables
            scaler = state.scaler
            if isinstance(scaler, DynamicLossScale):
                for leaf in jax.tree.leaves(scaler, is_leaf=is_graph_node):
                    leaf.set_metadata(**{CONFIG_METADATA: scaler.config})

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> None:
        """Applies the scaled ``grads`` to ``model``, or skips the step if they are not finite.

        ``kwargs`` go to the inner update; ``loss=`` is also checked. With
        ``max_replays``, ``value_fn=lambda model: loss_fn(model, batch)`` takes the
        *model*: a replay runs it on a copy merged from the replayed ``wrt`` arrays and
        the model's other variables, and discards what it writes there (docs/replay.md).
        Returns None: unlike ``nnx.Optimizer.update``, the updates never leave the skip
        decision (that is what makes the step cheap).
        """
        _refuse_swapped_update(model, grads)
        param_arrays = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
        grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
        opt_state_arrays = nnx.as_pure(self.opt_state)
        value_fn = kwargs.get("value_fn")
        if callable(value_fn):  # the model's loss, as the wrt arrays' loss, on a merged copy
            # Two filters, so three parts (nnx.split's type says "any length"); the rest as
            # arrays: a Variable of the model cannot enter the replay's trace.
            graphdef, _, rest = cast(Any, nnx.split(model, self.wrt, ..., graph=self.graph))
            rest = nnx.as_pure(rest)
            kwargs["value_fn"] = lambda params: value_fn(nnx.merge(graphdef, params, rest))
        kwargs_arrays = nnx.as_pure(kwargs)
        with provenance.called_as(CALLER):
            new_params, new_opt_state = apply_gradients(
                self.tx, grad_arrays, opt_state_arrays, param_arrays, **kwargs_arrays)
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_opt_state, graph=self.graph))
        self.step[...] += 1


UPDATE_ARGUMENTS = (
    "ls.nnx.Optimizer.update(model, grads): {problem}. Call `optimizer.update(model, "
    "grads)` with the Module first and the gradients from `ls.value_and_grad` second "
    "(the order of flax's nnx.Optimizer.update)."
)


def _refuse_swapped_update(model: Any, grads: Any) -> None:
    """A TypeError for ``update(grads, model)``: read as given, the params' own values
    would step the optimizer as if they were gradients and the model would stay put."""
    if isinstance(grads, nnx.Module):
        problem = (f"`grads` is a Module ({type(grads).__name__})"
                   + (" and `model` an nnx.State: the two are swapped"
                      if isinstance(model, nnx.State) else ""))
        raise TypeError(UPDATE_ARGUMENTS.format(problem=problem))
    if not is_graph_node(model):
        raise TypeError(UPDATE_ARGUMENTS.format(
            problem=f"`model` must be the nnx Module, got {show(model, type_only=True)}"))


# ------------------------------------------------- nnx states, for lookup and restore


def unwrap(x: Any) -> Any:
    """``x`` with its nnx Optimizers and States (anywhere, e.g. in ``{"model": ...,
    "optimizer": nnx.state(optimizer)}``) as optax states (:func:`_from_nnx_state`),
    Variables as their values."""
    def rebuild(node: Any) -> Any:
        if isinstance(node, nnx.Optimizer):
            node = node.opt_state
        return _from_nnx_state(node) if isinstance(node, nnx.State) else node

    x = jax.tree.map(rebuild, x, is_leaf=lambda v: isinstance(v, (nnx.Optimizer, nnx.State)))
    # get_value(): flax >= 0.12 deprecates `.value` (a DeprecationWarning on every call).
    return jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, x,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))


NO_CONFIG = (
    "This nnx.State holds the loss scale's values but not its configuration: a plain flax "
    "nnx.Optimizer does not keep it in its state (build the optimizer with "
    "`loss_scaling.nnx.Optimizer`, which does). Pass the optimizer itself instead.")


def _from_nnx_state(node: Any) -> Any:
    """Nested mappings with every wrapper state's mapping rebuilt as a LossScalingState.
    ``nnx.state`` drops the scaler's static configuration; ``Optimizer`` keeps it as
    Variable metadata. Without it (the state of a plain ``nnx.Optimizer``) there is no
    loss scale to rebuild: a ValueError (:data:`NO_CONFIG`)."""
    if not isinstance(node, Mapping):
        return node
    if is_state_mapping(node):
        fields = {k: _from_nnx_state(v) for k, v in node.items()}
        fields["scaler"] = _scaler_from_mapping(node.get("scaler", {}))
        if isinstance(fields.get("underflow"), Mapping):
            fields["underflow"] = UnderflowStats(**fields["underflow"])
        for name in LossScalingState._fields:
            fields.setdefault(name, {} if name == "inner_state" else None)
        return LossScalingState(**fields)
    return {k: _from_nnx_state(v) for k, v in node.items()}


def _scaler_from_mapping(node: Any) -> LossScale:
    names = set(node)
    if not names:
        return NoOpLossScale()
    if names == {"loss_scale"}:
        return jax.tree.unflatten(jax.tree.structure(StaticLossScale(1.0)), [node["loss_scale"]])
    metadata: dict[str, Any] = getattr(node.get("loss_scale"), "get_metadata", dict)()
    config: Any = metadata.get(CONFIG_METADATA)
    if config is None:
        raise ValueError(NO_CONFIG)
    return dynamic_from_leaves(config, tuple(node[name] for name in fields.dynamic_leaf_names(
        config.growth, alone=fields.FAILURE in node)))


def replace_scale(state: Any, new: LossScale, path: str | None) -> Any:
    """``replace_loss_scale`` for an ``nnx.Optimizer`` (in place) or a state holding
    ``nnx.Variable``s; ``NotImplemented`` for anything else."""
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    if not isinstance(state, nnx.Optimizer) and not any_leaf(is_variable, state):
        return NotImplemented

    target = without_failure(get_loss_scale(state, path))  # clear errors for none or several
    wrapper = wrapper_state(state, path)
    # The lookup returns the values the Variables hold: they identify the Variables.
    holder = state.opt_state if isinstance(state, nnx.Optimizer) else state
    variables = jax.tree.leaves(holder, is_leaf=is_variable)
    replace = {}
    pairs = [*zip(jax.tree.leaves(target), jax.tree.leaves(without_failure(new)), strict=True),
             (wrapper.failure, carried_failure(wrapper.failure, new))]
    for old_leaf, new_leaf in pairs:
        owners = [v for v in variables if is_variable(v) and v.get_value() is old_leaf]
        if len(owners) != 1:
            raise ValueError(
                f"restore_loss_scale found {len(owners)} nnx Variables holding one loss-scale "
                "array; it replaces exactly one: give each loss scale its own arrays.")
        replace[id(owners[0])] = new_leaf  # placed in old_leaf's layout by the caller
    if isinstance(state, nnx.Optimizer):
        for v in variables:
            if id(v) in replace:
                v.set_value(replace[id(v)])
        return state
    return jax.tree.map(lambda v: v.replace(replace[id(v)]) if id(v) in replace else v,
                        state, is_leaf=is_variable)


def _value_and_grad_for(state: Any, args: tuple[Any, ...], kwargs: Any,
                        argnums: Any) -> Callable[..., Any] | None:
    """``loss_scaling.value_and_grad``'s hook: this module's when ``nnx`` nodes take part."""
    return value_and_grad if any_leaf(is_graph_node, (state, args, kwargs)) else None


AUTOCAST_TAG = "loss_scaling.autocast"  # nnx's context tag for the lifted call


def autocast(call_pure: Callable[..., Any]) -> Callable[..., Any]:
    """``loss_scaling.autocast`` over ``nnx`` objects (the function itself may be one),
    lifted as ``nnx.jit`` lifts ``jax.jit``: the objects split into pytrees outside, merged
    inside, and what the function writes into them (BatchNorm statistics, RNG counts)
    written back after the call."""
    merged = general.merge_inputs(
        lambda fn, args, kwargs: fn(*args, **kwargs), ctxtag=AUTOCAST_TAG)

    def split(fn: Any, args: Any, kwargs: Any) -> Any:
        return call_pure(merged, (fn, args, kwargs))

    lifted = general.split_inputs(split, ctxtag=AUTOCAST_TAG)
    return lambda fn, *args, **kwargs: lifted(fn, args, kwargs)


def _owns(tree: Any) -> bool:
    return any_leaf(is_graph_node, tree)


# ------------------------------------------------------------- for the debugging tools


def _is_model(x: Any) -> bool:
    return isinstance(x, nnx.Module)


def _optimizer_wrt(x: Any) -> Any:
    """An ``nnx.Optimizer``'s ``wrt`` filter (what it trains); None for anything else."""
    return x.wrt if isinstance(x, nnx.Optimizer) else None


def _split_model(model: Any, wrt: Any) -> _registry.ModelSplit | None:
    """An nnx graph node as arrays: the ``wrt`` variables (``nnx.Param`` by default) and
    the rest; merged back into a fresh copy."""
    if not nnx.graph.is_graph_node(model):
        return None
    graphdef, diff_state, *other_states = nnx.split(model, wrt or nnx.Param, ...)
    return _registry.ModelSplit(
        nnx.as_pure(diff_state), [nnx.as_pure(o) for o in other_states],
        lambda diff, others: nnx.merge(graphdef, diff, *others), graphdef)


def _modules(root: Any) -> Any:
    """The nnx Modules of a graph node, by their paths in it (itself: ``()``)."""
    if nnx.graph.is_graph_node(root):
        yield from ((tuple(path), n) for path, n in nnx.iter_graph(root)
                    if isinstance(n, nnx.Module))


_registry.register("flax.nnx", _registry.Hooks(
    unwrap=unwrap, replace_scale=replace_scale, value_and_grad=_value_and_grad_for,
    owns=_owns, autocast=autocast, is_model=_is_model, optimizer_wrt=_optimizer_wrt,
    split_model=_split_model, modules=_modules))
