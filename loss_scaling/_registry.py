"""Hooks that the framework integrations fill, so that the core never imports a framework:
:func:`hooks` returns those of the frameworks the program has already imported (an nnx
object cannot exist without ``flax.nnx``), so a pure-optax program imports neither.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

# framework module -> the integration module that registers its hooks
INTEGRATIONS = {
    "flax.nnx": "loss_scaling.integrations.nnx",
    "equinox": "loss_scaling.integrations.equinox",
}


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
    """

    unwrap: Callable[[Any], Any] | None = None
    replace_scale: Callable[..., Any] | None = None
    value_and_grad: Callable[..., Any] | None = None
    owns: Callable[[Any], bool] | None = None
    autocast: Callable[..., Any] | None = None


_REGISTERED: dict[str, Hooks] = {}


def register(framework: str, hooks: Hooks) -> None:
    """Called by an integration module at import time."""
    _REGISTERED[framework] = hooks


def hooks() -> list[Hooks]:
    """The hooks of every integration whose framework is imported (importing the
    integration module on first use)."""
    for framework, module in INTEGRATIONS.items():
        if framework in sys.modules and framework not in _REGISTERED:
            importlib.import_module(module)
    return [h for f, h in _REGISTERED.items() if f in sys.modules]
