"""One step's scaled loss, forward then backward, as each recipe differentiates it, run
through the interpreter, and the same step compiled (README.md, "One step, as training
differentiates it" and "The compiled step")."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util

from loss_scaling import _registry
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
    """What to run: the user's loss function, its arguments, the scaler, and the filter of
    the variables an optimizer of a framework trains (``Hooks.optimizer_wrt``)."""

    fn: Callable[..., Any]  # as the user gave it
    has_aux: bool
    args: tuple[Any, ...]
    scaler: Any
    scale: float  # the scaler's, as a Python float
    wrt: Any

    def loss(self, *args: Any) -> Any:
        """The loss without aux."""
        return self.fn(*args)[0] if self.has_aux else self.fn(*args)


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
    held = _held_scale(first)
    wrt = _registry.first_answer(lambda h: h.optimizer_wrt and h.optimizer_wrt(first))
    if wrt is not None:  # a framework's optimizer: it holds the scale, and says what trains
        args = args[1:]
    elif held is not None:
        args = args[1:]
    if not args:
        raise TypeError(NO_ARGUMENTS)
    scaler = _scaler(scale, held)
    return Problem(loss_fn, has_aux, args, scaler, float(scaler.loss_scale), wrt)


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


@dataclasses.dataclass(frozen=True)
class Split:
    """The arguments taken apart: the differentiated leaves (``diff``, named by their path
    in ``names``), the other arrays (``others``: the batch, integer leaves, an nnx model's
    other state) and the rest, ``static`` (Python values, tree structures, an nnx
    GraphDef; ``None`` if one of them is not hashable). ``rebuild(diff, others)`` puts the
    arguments back together; it holds nothing but the static part, so a function of
    ``(diff, others)`` compiled once serves every call with the same static part."""

    diff: list[Any]
    names: list[str]
    others: list[Any]
    static: Any
    rebuild: Callable[[list[Any], list[Any]], tuple[Any, ...]]
    walk: Callable[[Any], Iterator[tuple[tuple[Any, ...], Any]]]


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _parts(tree_: Any) -> tuple[Any, list[str], list[Any]]:
    """A tree's structure, each leaf's kind (``"array"`` or ``"static"``) and its leaves."""
    leaves, treedef = jax.tree.flatten(tree_)
    return treedef, ["array" if _is_array(x) else "static" for x in leaves], leaves


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _assemble(kinds: tuple[str, ...], statics: tuple[Any, ...]
              ) -> Callable[[list[Any], list[Any]], list[Any]]:
    """Leaves in order from the differentiated ones, the other arrays and the statics."""
    def leaves(diff: list[Any], others: list[Any]) -> list[Any]:
        sources = {"diff": iter(diff), "array": iter(others), "static": iter(statics)}
        return [next(sources[kind]) for kind in kinds]
    return leaves


def _names(tree_: Any, keep: Callable[[Any], bool]) -> list[str]:
    return [jax.tree_util.keystr(path, simple=True, separator="/")
            for path, x in jax.tree_util.tree_flatten_with_path(tree_)[0] if keep(x)]


def _split(p: Problem) -> Split:
    """The differentiated leaves, the other arrays, the static rest and how to rebuild."""
    first, rest = p.args[0], p.args[1:]
    model = _registry.first_answer(lambda h: h.split_model and h.split_model(first, p.wrt))
    if model is not None:  # a framework's model (Hooks.split_model)
        # Arrays, not the model's Variables: the copy merged inside the trace owns fresh
        # ones, which BatchNorm and Dropout may write (the model is untouched).
        diff, diff_def = jax.tree.flatten(model.diff)
        treedef, kinds, leaves = _parts((model.others, rest))
        statics = tuple(x for k, x in zip(kinds, leaves, strict=True) if k == "static")
        assemble = _assemble(tuple(kinds), statics)

        def model_arguments(xs: list[Any], others: list[Any]) -> tuple[Any, ...]:
            states, rest_ = jax.tree.unflatten(treedef, assemble([], others))
            return (model.merge(jax.tree.unflatten(diff_def, xs), states), *rest_)

        static = _hashable(("model", model.static, diff_def, treedef, tuple(kinds), statics))
        return Split(diff, _names(model.diff, lambda _: True),
                     [x for k, x in zip(kinds, leaves, strict=True) if k == "array"],
                     static, model_arguments, _registry.modules)

    treedef, kinds, leaves = _parts((first, rest))
    n_first = len(jax.tree.leaves(first))
    kinds = ["diff" if i < n_first and _interpret.is_float(x) else k  # in tree.leaves order
             for i, (k, x) in enumerate(zip(kinds, leaves, strict=True))]
    statics = tuple(x for k, x in zip(kinds, leaves, strict=True) if k == "static")
    assemble = _assemble(tuple(kinds), statics)

    def arguments(xs: list[Any], others: list[Any]) -> tuple[Any, ...]:
        first_, rest_ = jax.tree.unflatten(treedef, assemble(xs, others))
        return (first_, *rest_)

    static = _hashable(("tree", treedef, tuple(kinds), statics))
    return Split([x for k, x in zip(kinds, leaves, strict=True) if k == "diff"],
                 _names(first, _interpret.is_float),
                 [x for k, x in zip(kinds, leaves, strict=True) if k == "array"],
                 static, arguments, _registry.modules)


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
    split = _split(p)

    def loss_times_scale(xs: list[Any], scaler: Any) -> Any:
        args = split.rebuild(xs, split.others)
        with _module_scopes(args[0], split.walk) if scopes else contextlib.nullcontext():
            loss = p.loss(*args)
        with jax.named_scope(SCALE_SCOPE):
            return tree.scale(scaler, loss)

    return split.diff, loss_times_scale


class Step(NamedTuple):
    """What the interpreter learned of one step: the origins (see ``_interpret``) of the
    scaled loss and of the gradients, and which origins were joined to which."""

    loss: Any
    grads: list[Any]
    joined: dict[int, set[int]]


def interpret_step(p: Problem, visit: Visitor, fresh: Fresh) -> Step:
    """Interprets the forward pass, then the backward pass of the scaled loss.

    Origins and places flow from the forward pass into the backward pass through the
    residuals.
    """
    leaves, scaled = scaled_loss_fn(p)
    forward, shape = jax.make_jaxpr(
        lambda xs: jax.vjp(lambda ys: scaled(ys, p.scaler), xs), return_shape=True)(leaves)
    interpreter = _interpret.Interpreter(visit, fresh, frame_of=user_frame)
    outs, origins, places = interpreter.eval_jaxpr(
        forward.jaxpr, forward.consts, leaves, Where("forward"),
        _interpret.arguments(leaves), _interpret.arguments(forward.consts))
    loss, vjp = jax.tree.unflatten(jax.tree.structure(shape), outs)
    cotangent = jnp.ones_like(loss)  # a constant of the backward jaxpr, not an equation
    backward = jax.make_jaxpr(lambda vjp: vjp(cotangent))(vjp)
    back = interpreter.eval_jaxpr(backward.jaxpr, backward.consts, jax.tree.leaves(vjp),
                                  Where("backward"), origins[1:],  # the residuals'
                                  places=places[1:])
    return Step(origins[0], back.origins, interpreter.joined)


def reaching(step: Step) -> set[int]:
    """The ids of the equations whose non-finite values reach the loss or a gradient: the
    origins they hold, and every origin joined to one of those (its inf/NaN went on in
    entries labelled by the earlier one; README.md, "The interpreter")."""
    found = set().union(*map(_interpret.origin_ids, (step.loss, *step.grads)))
    grew = True
    while grew:
        more = {k for k, targets in step.joined.items() if k not in found and targets & found}
        found |= more
        grew = bool(more)
    return found


# ------------------------------------------------------------------ the compiled step

# The compiled checks of the last few (loss function, static part) pairs: a second call
# with the same shapes compiles nothing. Bounded, so that the loss functions and static
# values it holds (and their executables) go once they drop out.
CACHE_SIZE = 8
_compiled: collections.OrderedDict[Any, Any] = collections.OrderedDict()


def _finite_leaves(fn: Callable[..., Any], has_aux: bool,
                   rebuild: Callable[[list[Any], list[Any]], tuple[Any, ...]]) -> Any:
    """``jax.jit`` of: the real step at scale ``s`` (``jax.value_and_grad`` of the loss
    times ``s``, as training differentiates it) -> whether the loss is finite, and per
    differentiated leaf whether its gradient is."""
    @jax.jit
    def finite_leaves(diff: list[Any], others: list[Any], s: Any) -> tuple[Any, Any]:
        scaler = jax.tree.map(lambda _: s, scalers.StaticLossScale(1.0))

        def loss_times_scale(xs: list[Any]) -> Any:
            out = fn(*rebuild(xs, others))
            return tree.scale(scaler, out[0] if has_aux else out)

        loss, grads = jax.value_and_grad(loss_times_scale)(diff)
        flags = [jnp.all(jnp.isfinite(g)) for g in grads]
        return jnp.isfinite(loss), jnp.stack(flags) if flags else jnp.ones(0, bool)

    return finite_leaves


class CompiledStep:
    """The real step, compiled once per static part and shapes: ``finite(scale)`` gives
    whether the loss is finite and, per differentiated leaf (``names``), whether its
    gradient is."""

    def __init__(self, p: Problem, run: Any, split: Split) -> None:
        self.p, self.run, self.split = p, run, split

    @property
    def names(self) -> list[str]:
        return self.split.names

    def finite(self, scale: float) -> tuple[bool, np.ndarray]:
        diff, others, s = self.split.diff, self.split.others, jnp.float32(scale)
        try:
            loss, leaves = self.run(diff, others, s)
        except jax.errors.JAXTypeError:
            # The loss needs one of the other arrays concrete (a shape, a Python branch):
            # compiled with them closed over, as the interpreter has them (not kept).
            split = self.split
            self.run = _finite_leaves(self.p.fn, self.p.has_aux,
                                      lambda xs, _: split.rebuild(xs, split.others))
            loss, leaves = self.run(diff, [], s)
        return bool(loss), np.asarray(leaves)


def compiled_step(p: Problem) -> CompiledStep:
    """The real step of ``p``, from the cache when the same loss function and static part
    were seen (then nothing is traced or compiled again: ``jax.jit`` keys its own cache
    by the arrays' shapes and dtypes)."""
    split = _split(p)
    key = None if split.static is None else _hashable((p.fn, p.has_aux, split.static))
    if key is None:  # something unhashable: compiled for this call only
        return CompiledStep(p, _finite_leaves(p.fn, p.has_aux, split.rebuild), split)
    if key not in _compiled:
        _compiled[key] = _finite_leaves(p.fn, p.has_aux, split.rebuild)
        while len(_compiled) > CACHE_SIZE:
            _compiled.popitem(last=False)
    _compiled.move_to_end(key)
    return CompiledStep(p, _compiled[key], split)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DEMO = os.path.join(_PACKAGE, "demo.py")  # the demo's model is user code


def user_frame(eqn: Any) -> Any:
    """The innermost frame of ``eqn``'s traceback outside JAX, the libraries around it
    (flax, Equinox, optax, ...: ``_registry.library_dirs``) and this one: the user's
    line."""
    skip = (_PACKAGE, *_registry.library_dirs())
    for frame in source_info_util.user_frames(eqn.source_info.traceback):
        if frame.file_name == _DEMO or not frame.file_name.startswith(skip):
            return frame
    return None
