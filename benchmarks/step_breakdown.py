"""Where the fused step's overhead goes: each mechanism switched off in turn.

    python benchmarks/step_breakdown.py [--params 2e8]

Times, interleaved in one process and as ratios to a bare ``optax.adam`` step:
the fused ``apply_gradients`` with defaults; with the opt-in host-callback raise; with a
boolean ``all(isfinite(unscale(g)))`` reduction instead of the bounded sum (patched in at
trace time: a diagnostic, not an API); with ``skip="select"``; with the opt-in underflow
statistics.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp
import optax
from overhead import SCALE, make_params  # type: ignore[import-not-found]

import loss_scaling as ls
from loss_scaling.core import numerics as tree


def boolean_leaves(grads, inverse, axis_name=None):
    """``tree.unscaled_finite_leaves`` as a boolean ``all(isfinite(unscale(g)))`` per leaf
    (the same decision; XLA on CPU materializes the mask instead of fusing the reduction)."""
    flags = [jnp.isfinite(tree.unscale_leaf(x, inverse)).all() for x in jax.tree.leaves(grads)]
    stacked = jnp.stack(flags)
    return stacked, stacked.all()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=20e6)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    params0 = make_params(args.params, 40)
    grads = jax.tree.map(lambda p: p * 1e-3 * SCALE, params0)
    inner = optax.adam(1e-3)
    boolean = mock.patch.object(tree, "unscaled_finite_leaves", boolean_leaves)

    def bare(p, s, g):
        u, s = inner.update(g, s, p)
        return optax.apply_updates(p, u), s

    def fused(**options):
        tx = ls.with_loss_scaling(inner, **options)
        # A new function per variant: jit caches traces by function identity.
        return (lambda p, s, g: ls.apply_gradients(tx, g, s, p)), tx.init

    variants = {
        "bare optax.adam": (bare, inner.init, []),
        "fused, defaults": (*fused(), []),
        "fused, on_failure='raise' (a host callback)": (*fused(on_failure="raise"), []),
        "fused, boolean all(isfinite) test": (*fused(), [boolean]),
        "fused, skip='select'": (*fused(skip="select"), []),
        "fused, underflow_diagnostics=True": (*fused(underflow_diagnostics=True), []),
    }
    compiled, carries = {}, {}
    for name, (step, init, patches) in variants.items():
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            p = jax.tree.map(jnp.copy, params0)
            s = init(p)
            compiled[name] = jax.jit(step, donate_argnums=(0, 1)).lower(p, s, grads).compile()
        carries[name] = jax.block_until_ready(compiled[name](p, s, grads))
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name in variants:
            start = time.perf_counter()
            carry = carries[name]
            for _ in range(args.steps):
                carry = compiled[name](*carry, grads)
            carries[name] = jax.block_until_ready(carry)
            times[name].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times["bare optax.adam"])
    print(f"backend={jax.default_backend()} params={args.params:.0e} bare={base * 1e3:.3f} ms")
    for name in variants:
        print(f"| {name} | {statistics.median(times[name]) / base:.2f}x |")


if __name__ == "__main__":
    main()
