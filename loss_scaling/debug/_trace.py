"""One step's scaled loss, forward then backward, as each recipe differentiates it, run
through the interpreter (README.md, "One step, as training differentiates it")."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import source_info_util

from loss_scaling._errors import show
from loss_scaling.core import scalers, tree
from loss_scaling.debug import _interpret
from loss_scaling.debug._interpret import Fresh, Visitor, Where
from loss_scaling.lookup import get_loss_scale

SCALE_SCOPE = "loss_scaling.scale"  # the scope of the loss-times-scale multiplication

BAD_SCALE = (
    "scale={value}: pass a positive finite number, a loss-scale state, or None (the "
    "scale held by the first argument, else 1)."
)
NO_ARGUMENTS = (
    "find_overflow / float16_report need loss_fn's arguments after it, the params (or "
    "model) first, optionally preceded by what holds the loss scale (an optimizer, "
    "opt_state, TrainState): `ls.find_overflow(loss_fn, params, batch)`."
)
TRACED = (
    "find_overflow / float16_report got a traced value ({what}): they run eagerly on "
    "concrete arrays. Call them outside jit / grad / vmap, beside the training loop."
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """What to run: the loss (without aux), its arguments, the scaler, nnx's ``wrt``."""

    loss_fn: Callable[..., Any]
    args: tuple[Any, ...]
    scaler: Any
    scale: float  # the scaler's, as a Python float
    wrt: Any


def _held_scale(first: Any) -> Any:
    if isinstance(first, scalers.SCALER_TYPES):
        return first
    if isinstance(first, jax.Array) or not jax.tree.leaves(first):
        return None
    try:
        return get_loss_scale(first)
    except (ValueError, TypeError, KeyError):
        return None


def problem(loss_fn: Callable[..., Any], args: tuple[Any, ...], scale: Any,
            has_aux: bool) -> Problem:
    """Splits off a leading holder of the loss scale and settles the scale to use."""
    for what, value in (("scale", scale), *((f"argument {i + 1}", a)
                                            for i, a in enumerate(args))):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(value)):
            raise TypeError(TRACED.format(what=what))
    first = args[0] if args else None
    held, wrt, nnx = _held_scale(first), None, sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(first, nnx.Optimizer):
        wrt, args = first.wrt, args[1:]
    elif held is not None:
        args = args[1:]
    if not args:
        raise TypeError(NO_ARGUMENTS)
    loss = (lambda *a: loss_fn(*a)[0]) if has_aux else loss_fn
    scaler = _scaler(scale, held)
    return Problem(loss, args, scaler, float(scaler.loss_scale), wrt)


def _scaler(scale: Any, held: Any) -> Any:
    if scale is None:
        return held if held is not None else scalers.NoOpLossScale()
    if isinstance(scale, scalers.SCALER_TYPES):
        return scale
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(BAD_SCALE.format(value=show(scale))) from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(BAD_SCALE.format(value=show(scale)))
    return scalers.StaticLossScale(value)


def _split(p: Problem) -> tuple[list[Any], Callable[[list[Any]], tuple[Any, ...]], Any]:
    """The differentiated leaves, how to rebuild the arguments, and the module walker."""
    first, rest, nnx = p.args[0], p.args[1:], sys.modules.get("flax.nnx")
    if nnx is not None and nnx.graph.is_graph_node(first):
        graphdef, diff, *others = nnx.split(first, p.wrt or nnx.Param, ...)
        # Arrays, not the model's Variables: the copy merged inside the trace owns fresh
        # ones, which BatchNorm and Dropout may write (the model is untouched).
        others = [nnx.as_pure(other) for other in others]
        leaves, treedef = jax.tree.flatten(nnx.as_pure(diff))

        def nnx_arguments(xs: list[Any]) -> tuple[Any, ...]:
            return (nnx.merge(graphdef, jax.tree.unflatten(treedef, xs), *others), *rest)

        return leaves, nnx_arguments, _nnx_modules

    def arguments(xs: list[Any]) -> tuple[Any, ...]:
        new = iter(xs)  # in the order of jax.tree.leaves
        return (jax.tree.map(lambda x: next(new) if _interpret.is_float(x) else x, first),
                *rest)

    return [x for x in jax.tree.leaves(first) if _interpret.is_float(x)], arguments, _eqx_modules


def _nnx_modules(root: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    nnx = sys.modules["flax.nnx"]
    yield from ((tuple(path), n) for path, n in nnx.iter_graph(root) if isinstance(n, nnx.Module))


def _eqx_modules(root: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    eqx = sys.modules.get("equinox")
    if eqx is None:
        return
    if not prefix and isinstance(root, eqx.Module):
        yield (), root
    is_child = lambda x: x is not root and isinstance(x, eqx.Module)  # noqa: E731
    for path, child in jax.tree_util.tree_flatten_with_path(root, is_leaf=is_child)[0]:
        if isinstance(child, eqx.Module):
            keys = (*prefix, *(jax.tree_util.keystr((k,), simple=True) for k in path))
            yield keys, child
            yield from _eqx_modules(child, keys)


@contextlib.contextmanager
def _module_scopes(root: Any, walk: Callable[[Any], Iterator[Any]]) -> Iterator[None]:
    """Each Module's ``__call__`` inside a named scope of its path, relative to its caller.

    A Module not reachable from ``root`` (one that ``nnx.scan`` merged in its body) is
    named by its class, and its own submodules are named below it.
    """
    modules = list(walk(root))
    paths = {id(m): path for path, m in modules}
    active: list[tuple[Any, ...]] = []
    patched: dict[type, Any] = {}

    def path_of(module: Any) -> tuple[Any, ...]:
        if id(module) not in paths:
            paths[id(module)] = base = (type(module).__name__,)
            for sub, child in walk(module):
                paths.setdefault(id(child), base + sub)
        return paths[id(module)]

    def scoped(original: Any) -> Any:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            path = path_of(self)
            if active and active[-1] == path or not path:  # super().__call__, or the root
                return original(self, *args, **kwargs)
            top = active[-1] if active else ()
            relative = path[len(top):] if path[:len(top)] == top and top else path
            active.append(path)
            try:
                with jax.named_scope(".".join(map(str, relative))):
                    return original(self, *args, **kwargs)
            finally:
                active.pop()
        return __call__

    for _, module in modules:
        cls = type(module)
        if cls not in patched and "__call__" in dir(cls):
            patched[cls] = cls.__dict__.get("__call__")
            type.__setattr__(cls, "__call__", scoped(cls.__call__))
    try:
        yield
    finally:
        for cls, original in patched.items():
            if original is None:
                type.__delattr__(cls, "__call__")
            else:
                type.__setattr__(cls, "__call__", original)


def scaled_loss_fn(p: Problem, scopes: bool = True) -> tuple[
        list[Any], Callable[[list[Any], Any], Any]]:
    """The differentiated leaves, and the loss times a scaler as a function of them."""
    leaves, arguments, walk = _split(p)

    def loss_times_scale(xs: list[Any], scaler: Any) -> Any:
        args = arguments(xs)
        with _module_scopes(args[0], walk) if scopes else contextlib.nullcontext():
            loss = p.loss_fn(*args)
        with jax.named_scope(SCALE_SCOPE):
            return tree.scale(scaler, loss)

    return leaves, loss_times_scale


def interpret_step(p: Problem, visit: Visitor, fresh: Fresh) -> tuple[Any, list[Any]]:
    """Interprets the forward pass, then the backward pass of the scaled loss; returns the
    origins (see ``_interpret``) of the scaled loss and of the gradients.

    Origins flow from the forward pass into the backward pass through the residuals.
    """
    leaves, scaled = scaled_loss_fn(p)
    forward, shape = jax.make_jaxpr(
        lambda xs: jax.vjp(lambda ys: scaled(ys, p.scaler), xs), return_shape=True)(leaves)
    interpreter = _interpret.Interpreter(visit, fresh)
    outs, origins = interpreter.eval_jaxpr(
        forward.jaxpr, forward.consts, leaves, Where("forward"),
        _interpret.arguments(leaves), _interpret.arguments(forward.consts))
    loss, vjp = jax.tree.unflatten(jax.tree.structure(shape), outs)
    cotangent = jnp.ones_like(loss)  # a constant of the backward jaxpr, not an equation
    backward = jax.make_jaxpr(lambda vjp: vjp(cotangent))(vjp)
    _, grad_origins = interpreter.eval_jaxpr(backward.jaxpr, backward.consts,
                                             jax.tree.leaves(vjp), Where("backward"),
                                             origins[1:])  # the residuals'
    return origins[0], grad_origins


def reaching(loss_origin: Any, grad_origins: list[Any]) -> set[int]:
    """The ids of the equations whose non-finite values reach the loss or a gradient."""
    return set().union(*map(_interpret.origin_ids, (loss_origin, *grad_origins)))


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DEMO = os.path.join(_PACKAGE, "demo.py")  # the demo's model is user code
_FRAMEWORKS = ("flax", "equinox", "optax", "haiku", "chex")


def user_frame(eqn: Any) -> Any:
    """The innermost frame of ``eqn``'s traceback outside JAX, the frameworks (flax,
    Equinox, optax, ...) and this library: the user's line."""
    files = (getattr(sys.modules.get(name), "__file__", None) for name in _FRAMEWORKS)
    skip = (_PACKAGE, *(os.path.dirname(f) + os.sep for f in files if f))
    for frame in source_info_util.user_frames(eqn.source_info.traceback):
        if frame.file_name == _DEMO or not frame.file_name.startswith(skip):
            return frame
    return None
