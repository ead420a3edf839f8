"""Scratch memory of the compiled step, against the same step without loss scaling.

XLA's ``compiled.memory_analysis().temp_size_in_bytes`` is what a step needs beyond its
arguments and outputs: exact and the same on every run, so it is tested here (the time a
step takes is measured in ``benchmarks/overhead.py``). The steps are lowered from
``ShapeDtypeStruct`` trees, so nothing of the model's size is allocated.

What the library may add on top of the bare step:

* the fused step (``ls.apply_gradients``), with either growth rule, with or without
  ``loss=``: nothing that grows with the model (:data:`FIXED`, small per-leaf scalars);
* the plain step (``tx.update``, then ``optax.apply_updates``): the updates tree, which
  leaves the skip decision and so must exist (docs/performance.md);
* a whole train step (the gradients computed in the step): the gradients, which must
  exist before the decision, as in a guard written by hand; replay adds its own
  recomputed gradients.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scaling as ls

FIXED = 2**19
"""What the fused step may need beyond the bare step, at any model size: 0.5 MiB."""

ADAM = optax.adam(1e-3)

# Leaves of one shape, where XLA CPU once kept a leaf-sized broadcast of each scalar that
# their reductions share (5.73 MiB at 20M params in 40 leaves, 11.4 MiB at 4M in 4); a
# layout of matrices beside vectors.
LAYOUTS = {
    "4M in 40 leaves": [(100_000,)] * 40,
    "8M in 40 leaves": [(200_000,)] * 40,
    "20M in 40 leaves": [(500_000,)] * 40,
    "4M in 4 leaves": [(1_000_000,)] * 4,
    "matrices and vectors": [(1000, 500), (500,)] * 8,
}


def params_of(shapes: list[tuple[int, ...]], dtype: Any = jnp.float32) -> dict[str, Any]:
    return {f"w{i:02d}": jax.ShapeDtypeStruct(shape, dtype) for i, shape in enumerate(shapes)}


def nbytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def temp_bytes(step: Any, *args: Any) -> int:
    """The compiled step's scratch bytes, params and optimizer state donated."""
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def bare_step(params: Any, opt_state: Any, grads: Any) -> Any:
    updates, opt_state = ADAM.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def fused_step(tx: Any, with_loss: bool = False) -> Any:
    def step(params: Any, opt_state: Any, grads: Any) -> Any:
        extra = {"loss": jnp.float32(1.0)} if with_loss else {}
        return ls.apply_gradients(tx, grads, opt_state, params, **extra)

    return step


def plain_step(tx: Any) -> Any:
    def step(params: Any, opt_state: Any, grads: Any) -> Any:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


SCALERS = {
    "interval": lambda: ls.DynamicLossScale(),
    "headroom": lambda: ls.DynamicLossScale(growth="headroom"),
    "static": lambda: ls.StaticLossScale(2.0**15),
}


@pytest.fixture(scope="module")
def bare_temp() -> dict[str, int]:
    return {name: temp_bytes(bare_step, params_of(shapes),
                             jax.eval_shape(ADAM.init, params_of(shapes)), params_of(shapes))
            for name, shapes in LAYOUTS.items()}


@pytest.mark.parametrize("scaler", list(SCALERS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_fused_step_needs_no_scratch_memory_that_grows_with_the_model(
        layout: str, scaler: str, bare_temp: dict[str, int]) -> None:
    params = params_of(LAYOUTS[layout])
    tx = ls.with_loss_scaling(ADAM, SCALERS[scaler]())
    opt_state = jax.eval_shape(tx.init, params)
    for with_loss in (False, True):
        extra = temp_bytes(fused_step(tx, with_loss), params, opt_state, params) \
            - bare_temp[layout]
        assert extra < FIXED, (
            f"{layout}, {scaler}, loss={'given' if with_loss else 'not given'}: the fused "
            f"step needs {extra / 2**20:.2f} MiB more scratch memory than bare Adam "
            f"({nbytes(params) / 2**20:.0f} MiB of gradients)")


@pytest.mark.parametrize("layout", ["4M in 40 leaves", "4M in 4 leaves"])
def test_the_plain_step_needs_the_updates_tree_and_nothing_more(
        layout: str, bare_temp: dict[str, int]) -> None:
    params = params_of(LAYOUTS[layout])
    tx = ls.with_loss_scaling(ADAM)
    extra = temp_bytes(plain_step(tx), params, jax.eval_shape(tx.init, params), params) \
        - bare_temp[layout]
    assert extra < nbytes(params) + FIXED, f"{extra / 2**20:.2f} MiB"


def loss_fn(params: Any, x: Any) -> jax.Array:
    return sum(jnp.sum(p.astype(jnp.float16) * x[k].astype(jnp.float16), dtype=jnp.float32)
               for k, p in params.items())


@pytest.mark.parametrize("max_replays", [0, 2])
def test_a_train_step_needs_the_gradients_once_beside_the_bare_train_step(
        max_replays: int) -> None:
    """A whole step: the gradients exist before the decision (a hand-written guard needs
    them too), and replay's recomputed gradients live in its loop beside them."""
    params = params_of(LAYOUTS["4M in 40 leaves"])

    def bare(params: Any, opt_state: Any, x: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        return *bare_step(params, opt_state, grads), loss

    tx = ls.with_loss_scaling(ADAM, max_replays=max_replays)

    def scaled(params: Any, opt_state: Any, x: Any) -> Any:
        loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, x)
        extra = {"value_fn": lambda p: loss_fn(p, x)} if max_replays else {}
        return *ls.apply_gradients(tx, grads, opt_state, params, loss=loss, **extra), loss

    base = temp_bytes(bare, params, jax.eval_shape(ADAM.init, params), params)
    extra = temp_bytes(scaled, params, jax.eval_shape(tx.init, params), params) - base
    gradients = nbytes(params) * (2 if max_replays else 1)
    assert extra < gradients + FIXED, f"{extra / 2**20:.2f} MiB"


def test_all_finite_needs_no_scratch_memory() -> None:
    params = params_of(LAYOUTS["4M in 40 leaves"])
    compiled = jax.jit(ls.all_finite).lower(params).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < FIXED
