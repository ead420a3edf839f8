"""``ls.autocast`` on a zoo of float32 models written without any dtype (autocast_zoo.py):
the program it makes (read with the tests' own walker), its numerics against float32, and
150 training steps with ``ls.with_loss_scaling`` against the float32 run."""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from autocast_zoo import ZOO, model, train_in_one_scan
from jaxpr_walk import flops_by_dtype, forward_and_grad, half_fraction, reading_half

import loss_scaling as ls

NAMES = list(ZOO)
RANGE_OPS = {"exp", "log", "log1p", "rsqrt", "reduce_sum", "cumsum", "pow", "integer_pow"}


@functools.cache
def loss_of(name: str, autocast: bool) -> Any:
    """The model's loss, float32 or under ``ls.autocast``: one object per model for the whole
    file, so that autocast traces and rewrites it once per input signature."""
    return model(name).loss(ls.autocast) if autocast else model(name).loss()


@functools.cache
def value_and_grad_of(name: str, autocast: bool) -> Any:
    """``jax.jit(jax.value_and_grad(loss))``, traced and compiled once for the whole file."""
    return jax.jit(jax.value_and_grad(loss_of(name, autocast)))


@pytest.mark.parametrize("name", NAMES)
def test_the_autocast_program(name: str) -> None:
    m = model(name)
    batch = m.batch(0)
    forward, value_and_grad = forward_and_grad(loss_of(name, True), m.params, batch)
    # at least 90% of the matmul/conv FLOPs of the whole value_and_grad in float16
    assert half_fraction(value_and_grad) >= 0.9, flops_by_dtype(value_and_grad)
    # no range-sensitive op reads float16 in the forward pass
    assert reading_half(forward, RANGE_OPS) == []
    # the loss is float32, and so is every gradient of a float32 param
    loss, grads = value_and_grad_of(name, True)(m.params, batch)
    assert loss.dtype == jnp.float32
    chex.assert_trees_all_equal_dtypes(grads, m.params)


@pytest.mark.parametrize("name", NAMES)
def test_loss_and_gradients_agree_with_float32(name: str) -> None:
    m = model(name)
    for step in range(3):
        batch = m.batch(step)
        loss32, grads32 = value_and_grad_of(name, False)(m.params, batch)
        loss16, grads16 = value_and_grad_of(name, True)(m.params, batch)
        assert abs(float(loss16) - float(loss32)) <= 0.02 * abs(float(loss32))
        a, b = (jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)])
                for t in (grads32, grads16))
        assert float(a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b))) >= 0.99


@pytest.mark.parametrize("name", NAMES)
def test_150_steps_with_loss_scaling_track_the_float32_run(name: str) -> None:
    m = model(name)
    batches = jax.tree.map(lambda *xs: jnp.stack(xs), *[m.batch(s) for s in range(150)])
    losses32, _ = train_in_one_scan(loss_of(name, False), m.params, batches, optax.adam(1e-3),
                         scaled=False)
    tx = ls.with_loss_scaling(optax.adam(1e-3))
    losses16, opt_state = train_in_one_scan(loss_of(name, True), m.params, batches, tx, scaled=True)
    ls.check(opt_state)
    assert np.isfinite(losses16).all()
    # the default initial scale (2**15) backs off on the first steps at most
    assert int(ls.metrics(opt_state)["skipped_steps"]) <= 10
    # tracking: the curves (10-step means, so one noisy batch is not a verdict) stay within
    # 10% of the initial loss of each other, and end within 2% of it, after real progress
    smooth = lambda x: np.convolve(x, np.ones(10) / 10, mode="valid")  # noqa: E731
    start = losses32[0]
    assert losses32[-20:].mean() < 0.8 * start
    assert np.abs(smooth(losses16) - smooth(losses32)).max() <= 0.1 * start
    assert abs(losses16[-20:].mean() - losses32[-20:].mean()) <= 0.02 * start
