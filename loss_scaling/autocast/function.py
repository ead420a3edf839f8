""":func:`autocast`: a float32 function run in float16, traced and rewritten once per input
signature (README.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import api_util, core
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe

from loss_scaling import _registry
from loss_scaling.autocast.policy import DEFAULT, AutocastPolicy
from loss_scaling.autocast.rewrite import Context, Row, rewrite_closed

HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))

BAD_DTYPE = ("ls.autocast(dtype=...) must be a 16-bit floating dtype, jnp.float16 or "
             "jnp.bfloat16, got {value}. For float32 compute, call the function without "
             "ls.autocast.")
BAD_POLICY = ("ls.autocast(policy=...) must be an ls.AutocastPolicy or None, got {value}. "
              "Write ls.AutocastPolicy(float32=('Model/head',)) to keep modules in float32, "
              "or pass report.policy from ls.autocast_report.")
NOT_CALLABLE = "ls.autocast(fn) needs a function to cast, got {value}."
NOT_AN_ARRAY = ("ls.autocast({name}) returned {what} at output {path}; an autocast function "
                "returns arrays (and pytrees of them), as jax.jit does. Return the value as "
                "an array, or move the non-array result out of the function.")


def half_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a NumPy dtype if it is float16 or bfloat16; a ``ValueError`` naming
    ``dtype`` otherwise."""
    try:
        half = np.dtype(dtype)
    except TypeError:
        half = None
    if half not in HALF_DTYPES:
        raise ValueError(BAD_DTYPE.format(value=repr(dtype)))
    return half


def checked_policy(policy: Any) -> AutocastPolicy:
    if policy is None:
        return DEFAULT
    if not isinstance(policy, AutocastPolicy):
        raise TypeError(BAD_POLICY.format(value=_describe(policy)))
    return policy


def autocast(fn: Callable[..., Any], *, dtype: Any = jnp.float16,
             policy: AutocastPolicy | None = None) -> Autocast:
    """``fn``, a float32 function, computing in ``dtype`` where that is safe.

    The returned function has ``fn``'s signature and output structure. On its first call
    with an input signature it traces ``fn`` to a jaxpr and rewrites every equation by the
    rules of docs/autocast.md (matmuls and convolutions in ``dtype``; ``exp``, ``log``,
    sums and powers in float32; everything else in the widest dtype of its operands),
    inside ``jit``, ``scan``, ``while``, ``cond``, ``checkpoint``, ``shard_map`` and custom
    rules; later calls with that signature reuse the rewrite. Its outputs have the dtypes
    ``fn`` gives them, and the gradients of float32 params are float32.

    Array leaves of the arguments (``jax.Array``, NumPy arrays) are traced; every other
    leaf is static, as ``equinox.filter_jit`` treats them: a new value traces again. flax
    ``nnx`` modules are passed as ``nnx.jit`` takes them, and what ``fn`` writes into them
    (BatchNorm statistics, RNG counts) is written back.

    Args:
      fn: the function, written in float32.
      dtype: ``jnp.float16`` (with loss scaling: :func:`loss_scaling.with_loss_scaling`)
        or ``jnp.bfloat16`` (no loss scale needed).
      policy: an :class:`~loss_scaling.AutocastPolicy`: equations to keep in float32
        (``report.policy`` of :func:`loss_scaling.autocast_report` finds them).

    Returns:
      The autocast function.

    Raises:
      ValueError: ``dtype`` is not a 16-bit floating dtype.
      TypeError: ``policy`` is not an ``AutocastPolicy``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import loss_scaling as ls
      >>> def loss_fn(w, x):
      ...     return jnp.mean(jax.nn.log_softmax(x @ w))
      >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
      >>> loss, grad = jax.value_and_grad(ls.autocast(loss_fn))(w, x)
      >>> loss.dtype, grad.dtype
      (dtype('float32'), dtype('float32'))
    """
    if not callable(fn):
        raise TypeError(NOT_CALLABLE.format(value=_describe(fn)))
    return Autocast(fn, half_dtype(dtype), checked_policy(policy))


@dataclasses.dataclass(frozen=True)
class Traced:
    """One input signature's rewrite: the program, its output tree, and its runner."""

    jaxpr: core.ClosedJaxpr
    out_tree: Any
    run: Callable[..., Any]


class Autocast:
    """The function :func:`autocast` returns (see there); ``.fn``, ``.dtype``,
    ``.policy`` are what it was given."""

    def __init__(self, fn: Callable[..., Any], dtype: np.dtype, policy: AutocastPolicy):
        functools.update_wrapper(self, fn)
        self.fn, self.dtype, self.policy = fn, dtype, policy
        self._traced: dict[Hashable, Traced] = {}
        self._lifted: dict[int, Callable[..., Any]] = {}

    def __repr__(self) -> str:
        return f"ls.autocast({getattr(self.fn, '__name__', self.fn)!r}, dtype={self.dtype})"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:  # a method stays a method
        return self if obj is None else functools.partial(self, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for index, hooks in enumerate(_registry.hooks()):
            if hooks.owns is not None and hooks.autocast is not None and hooks.owns(
                    (self.fn, args, kwargs)):
                if index not in self._lifted:
                    self._lifted[index] = hooks.autocast(self.call_pure)
                return self._lifted[index](self.fn, *args, **kwargs)
        return self.call_pure(self.fn, args, kwargs)

    def call_pure(self, fn: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any] | None = None) -> Any:
        """``fn(*args, **kwargs)`` autocast, for a function and arguments that are pytrees
        (a function that is a pytree, an Equinox module, has its arrays traced too)."""
        call = Call(fn, args, kwargs or {})
        traced = self._traced.get(call.key)
        if traced is None:
            traced = self.trace(call)
            if not any(isinstance(c, core.Tracer) for c in traced.jaxpr.consts):
                self._traced[call.key] = traced  # not when fn closes over a traced value
        if any(isinstance(x, core.Tracer) for x in call.arrays):  # inside a trace: inline
            outs = core.eval_jaxpr(traced.jaxpr.jaxpr, traced.jaxpr.consts, *call.arrays)
        else:
            outs = traced.run(*call.arrays)
        return jax.tree.unflatten(traced.out_tree, outs)

    def trace(self, call: Call, rows: dict[Any, Row] | None = None) -> Traced:
        """``call``'s autocast program (``rows``, when given, receive the report's rows)."""
        closed, out_tree = call.jaxpr()
        new = rewrite(closed, self.dtype, self.policy, rows)
        name = f"autocast_{getattr(call.fn, '__name__', type(call.fn).__name__)}"

        def run(*xs: Any) -> list[Any]:
            return core.eval_jaxpr(new.jaxpr, new.consts, *xs)

        run.__name__ = run.__qualname__ = name
        return Traced(new, out_tree, jax.jit(run))


class Call:
    """``fn(*args, **kwargs)`` split as ``equinox.filter_jit`` splits it: array leaves
    traced, every other leaf static."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.fn = fn
        self.leaves, self.treedef = jax.tree.flatten((fn, args, kwargs))
        self.dynamic = [is_array(x) or isinstance(x, jax.ShapeDtypeStruct) for x in self.leaves]
        self.arrays = [x for x, d in zip(self.leaves, self.dynamic, strict=True) if d]
        self.avals = [_aval(x) for x in self.arrays]
        self.key = (self.treedef, tuple(
            None if d else _static_key(x) for x, d in zip(self.leaves, self.dynamic,
                                                          strict=True)), tuple(self.avals))

    @functools.cache  # noqa: B019  (a Call lives for one call)
    def jaxpr(self) -> tuple[core.ClosedJaxpr, Any]:
        """The float32 program and its output tree; an error naming an output that is not
        an array. Traced in the current context with the arguments' own types (their
        sharding, and inside ``shard_map`` the axes they vary over)."""
        leaves, dynamic, treedef = self.leaves, self.dynamic, self.treedef
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        out_tree: list[Any] = []

        def flat(*xs: Any) -> list[Any]:
            it = iter(xs)
            fn, args, kwargs = jax.tree.unflatten(
                treedef, [next(it) if d else x for x, d in zip(leaves, dynamic, strict=True)])
            out = fn(*args, **kwargs)
            for path, leaf in jax.tree_util.tree_leaves_with_path(out):
                if not isinstance(leaf, core.Tracer) and not is_array(leaf):
                    raise TypeError(NOT_AN_ARRAY.format(
                        name=name, what=_describe(leaf),
                        path=jax.tree_util.keystr(path) or "(the result)"))
            outs, tree = jax.tree.flatten(out)
            out_tree.append(tree)
            return outs

        debug = api_util.debug_info("ls.autocast", flat, (*self.avals,), {})
        jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(flat, debug_info=debug),
                                                     self.avals)
        return core.ClosedJaxpr(jaxpr, consts), out_tree[0]


def _aval(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return core.ShapedArray(x.shape, x.dtype, weak_type=x.weak_type)
    return core.typeof(x)


def context(dtype: Any, policy: AutocastPolicy, rows: dict[Any, Row] | None = None,
            matched: set[Any] | None = None) -> Context:
    """The rewrite's context for a half dtype and a policy (``matched`` receives the
    policy's sites that named an equation)."""
    return Context(np.dtype(dtype), functools.partial(policy.decide, matched=matched), rows)


def rewrite(closed: core.ClosedJaxpr, dtype: np.dtype, policy: AutocastPolicy,
            rows: dict[Any, Row] | None = None) -> core.ClosedJaxpr:
    """The autocast program of a float32 ``closed`` jaxpr: its outputs in their own
    dtypes."""
    new, _ = rewrite_closed(context(dtype, policy, rows), closed, closed.in_avals,
                            pin_out=[getattr(a, "dtype", None) for a in closed.out_avals])
    return new


def is_array(x: Any) -> bool:
    """The leaves autocast traces (as ``equinox.is_array``: JAX and NumPy arrays)."""
    return isinstance(x, jax.Array | np.ndarray | np.generic)


class _Identity:
    """An unhashable static leaf, compared by identity (and kept alive by the cache)."""

    def __init__(self, x: Any):
        self.x = x

    def __hash__(self) -> int:
        return id(self.x)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.x is self.x


def _static_key(x: Any) -> Hashable:
    try:
        hash(x)
    except TypeError:
        return _Identity(x)
    return x


def _describe(x: Any) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
