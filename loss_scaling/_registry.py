"""Hooks that the framework integrations fill, so that no other layer imports a framework:
:func:`hooks` returns those of the frameworks the program has already imported (an nnx
object cannot exist without ``flax.nnx``), so a pure-optax program imports neither.

The one import that points up: :data:`INTEGRATIONS` names, per framework, the integration
module that registers its hooks, and :func:`hooks` imports it (``importlib``) the first
time it is asked once that framework is in ``sys.modules``. Nothing else here imports a
module of this package or a framework; :func:`library_dirs` only locates the libraries'
folders (``importlib.util.find_spec``), importing nothing.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

INTEGRATIONS = {
    "flax.nnx": "loss_scaling.integrations.nnx",
    "equinox": "loss_scaling.integrations.equinox",
}
"""framework module -> the integration module that registers its hooks, imported by
:func:`hooks` once the framework is (``loss_scaling.integrations.linen`` registers its own
on import: the package root imports it)."""

LIBRARIES = ("flax", "equinox", "optax", "haiku", "chex", "loss_scaling")
"""The libraries between a user's code and JAX: their frames are not the user's line."""


class ModelSplit(NamedTuple):
    """A framework model taken apart for the debugging tools (``Hooks.split_model``).

    Attributes:
      diff: the arrays to differentiate, as a pytree (their paths name them).
      others: the model's other state, as pytrees of arrays.
      merge: ``(diff, others) -> model``: a fresh model from the two (writes into it do
        not reach the user's model).
      static: a hashable key of what is not arrays (the model's structure).
    """

    diff: Any
    others: list[Any]
    merge: Callable[[Any, list[Any]], Any]
    static: Any


class Hooks(NamedTuple):
    """What one integration tells the core.

    Attributes:
      unwrap: ``state -> state`` with the framework's containers replaced by the optax
        states they hold (lookup), or ``None``.
      replace_scale: ``(state, new_scaler, path) -> state | NotImplemented``: the loss
        scale inside a framework state replaced (checkpoint restore), or ``None``.
      value_and_grad: ``(state, args, kwargs, argnums) -> factory | None``: when the
        arguments hold the framework's modules, a ``(fun, argnums, has_aux) -> f``
        factory of its gradient function (``loss_scaling.value_and_grad``), or ``None``.
      owns: ``tree -> bool``: whether a pytree holds the framework's objects (modules that
        are not plain pytrees), or ``None``.
      autocast: ``call_pure -> f``: ``f(fn, *args, **kwargs)`` calls ``fn`` on the
        framework's objects through ``call_pure(pure_fn, args, kwargs)``
        (``loss_scaling.autocast`` of pytrees), and writes back what ``fn`` wrote into the
        objects; or ``None``.
      is_model: ``x -> bool``: whether ``x`` is one of the framework's models (named when
        it is passed where an optimizer state was wanted), or ``None``.
      optimizer_wrt: ``x -> filter | None``: for the framework's optimizer, the filter of
        the variables it trains (the debugging tools differentiate those), else ``None``.
      split_model: ``(model, wrt) -> ModelSplit | None``: the framework's model taken
        apart for the debugging tools (``wrt``: the filter, or ``None`` for the default),
        ``None`` for anything else.
      modules: ``root -> iterator of (path, module)``: the framework's modules in ``root``
        (itself included, with path ``()``), their paths relative to it (the debugging
        tools name layers by them); nothing for anything else.
    """

    unwrap: Callable[[Any], Any] | None = None
    replace_scale: Callable[..., Any] | None = None
    value_and_grad: Callable[..., Any] | None = None
    owns: Callable[[Any], bool] | None = None
    autocast: Callable[..., Any] | None = None
    is_model: Callable[[Any], bool] | None = None
    optimizer_wrt: Callable[[Any], Any] | None = None
    split_model: Callable[[Any, Any], ModelSplit | None] | None = None
    modules: Callable[[Any], Iterator[tuple[tuple[Any, ...], Any]]] | None = None


_REGISTERED: dict[str, Hooks] = {}


def register(framework: str, hooks: Hooks) -> None:
    """Called by an integration module at import time."""
    _REGISTERED[framework] = hooks


def hooks() -> list[Hooks]:
    """The hooks of every integration whose framework is imported (importing the
    integration module on first use: the edge of :data:`INTEGRATIONS`)."""
    for framework, module in INTEGRATIONS.items():
        if framework in sys.modules and framework not in _REGISTERED:
            importlib.import_module(module)
    return [h for f, h in _REGISTERED.items() if f in sys.modules]


def first_answer(ask: Callable[[Hooks], Any]) -> Any:
    """The first answer other than ``None`` that ``ask(hooks)`` gives over :func:`hooks`."""
    for each in hooks():
        answer = ask(each)
        if answer is not None:
            return answer
    return None


def modules(root: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every imported framework's modules in ``root`` (``Hooks.modules``)."""
    for each in hooks():
        if each.modules is not None:
            yield from each.modules(root)


@functools.cache
def library_dirs(with_jax: bool = False) -> tuple[str, ...]:
    """The folders of :data:`LIBRARIES` that are installed (and JAX's, when asked), each
    ending in a separator: a frame whose file starts with one is not the user's."""
    dirs: list[str] = []
    for name in (*LIBRARIES, *(("jax",) if with_jax else ())):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(os.path.join(p, "") for p in spec.submodule_search_locations)
    return tuple(dirs)
