"""Behaviour checks that only an accelerator can answer; prints one line per check.

    python benchmarks/device_check.py

Run on a GPU or TPU host (the CPU test suite covers the rest): the fail-closed state of a
jitted step, subnormal handling of the backoff and of the reciprocal, and a skipped step's
bit-identity, on the default backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import loss_scaling as ls


def main() -> None:
    print(f"backend={jax.default_backend()} devices={jax.devices()}")

    # 1. A backoff into the subnormal range fails closed under jit (GPUs keep subnormals):
    # recorded in the state, raised on the host by ls.check.
    s = ls.DynamicLossScale(init_scale=2.0**-125)
    step = jax.jit(ls.update)
    s = step(s, jnp.array(False))
    failed = step(s, jnp.array(False))
    try:
        ls.check(failed)
        print("fail-closed under jit: NOT RECORDED (bug)")
    except ls.LossScaleError as e:
        print(f"fail-closed under jit: recorded (failure={int(failed.failure)}), scale kept at "
              f"{float(failed.loss_scale)!r}, ls.check names it: {'loss scale' in str(e)}")

    # 1b. Unscale above 2**126 (the reciprocal is subnormal) gives the true gradient.
    one = ls.unscale(ls.StaticLossScale(2.0**127), jnp.float32(2.0**127))
    print(f"unscale at scale 2**127 of 2**127: {float(one)!r} (want 1.0)")

    # 2. Skipped steps leave params bit-identical, -0.0 included, on both paths.
    params = {"w": jnp.array([-0.0, 1.5, -2.0], jnp.float32),
              "h": jnp.array([-0.0, 3.0], jnp.float16)}
    bad = {"w": jnp.array([1.0, jnp.nan, 1.0]), "h": jnp.array([1.0, 1.0], jnp.float16)}
    for skip in ("cond", "select"):
        tx = ls.with_loss_scaling(optax.adam(1e-3), skip=skip)
        state = tx.init(params)
        updates, _ = jax.jit(tx.update)(bad, state, params)
        plain = optax.apply_updates(params, updates)
        fused, _ = jax.jit(lambda g, s, p, tx=tx: ls.apply_gradients(tx, g, s, p))(
            bad, state, params)
        same = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                   for out in (plain, fused)
                   for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(params), strict=True))
        print(f"skip={skip}: skipped step bit-identical on plain and fused paths: {same}")


if __name__ == "__main__":
    main()
