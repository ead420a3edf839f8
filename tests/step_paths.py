"""The three paths of one optimizer step that the README shows, for tests that run each:
``plain`` (``tx.update`` + ``optax.apply_updates``), ``fused`` (``ls.apply_gradients``)
and ``train_state`` (``ls.TrainState.apply_gradients``)."""

from __future__ import annotations

import functools

import jax
import optax
import pytest

import loss_scaling as ls

DONATING_JIT = functools.partial(jax.jit, donate_argnums=(1, 2))
EAGER_OR_DONATING_JIT = pytest.mark.parametrize(
    "maybe_jit", [lambda f: f, DONATING_JIT], ids=["eager", "jit_donate"])
PATHS = pytest.mark.parametrize("path", ["plain", "fused", "train_state"])


def step_by(tx, path):
    """``step(grads, opt_state, params, **extra) -> (params, opt_state)`` by one path."""

    def step(grads, opt_state, params, **extra):
        if path == "plain":
            updates, opt_state = tx.update(grads, opt_state, params, **extra)
            return optax.apply_updates(params, updates), opt_state
        if path == "fused":
            return ls.apply_gradients(tx, grads, opt_state, params, **extra)
        state = ls.TrainState(step=0, apply_fn=None, params=params, tx=tx, opt_state=opt_state)
        state = state.apply_gradients(grads=grads, **extra)
        return state.params, state.opt_state

    return step
