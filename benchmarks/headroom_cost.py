"""Cost of ``growth="headroom"`` on a healthy fused step, side by side in one process.

The headroom rule needs max |g| of the scaled gradients; the wrapper takes it from the
finite screen's own read (a sibling max |g| of the leaves the screen sums, in the same
collective). This script times the default fused step, the same step with
``growth="headroom"``, and a bare ``optax.adam`` step, interleaved round after round
(the harness of ``overhead.py``: params and state donated, one step per
``block_until_ready`` and pipelined), and reports each as a ratio to the default fused
step (the target: headroom at most 1.02x) and to bare Adam. The timed steps follow
``--warmup`` steps, so they are the steady state: the max read on one clean step in
``headroom_window`` (16), as on XLA CPU the wrapper reads it in a pass of its own.

    python benchmarks/headroom_cost.py                 # 20M float32 params, 40 leaves
    python benchmarks/headroom_cost.py --params 2e8    # a size that loads a GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).parent))
from overhead import (  # noqa: E402
    MODES,
    SCALE,
    bare_adam,
    interleaved,
    loss_scaling_fused,
    make_params,
)

import loss_scaling as ls  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=20e6)
    parser.add_argument("--leaves", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=40,
                        help="steps before timing (the headroom window fills in 16)")
    args = parser.parse_args(argv)

    params0 = make_params(args.params, args.leaves)
    true_grads = jax.tree.map(lambda p: p * 1e-3, params0)
    scaled = jax.tree.map(lambda g: g * SCALE, true_grads)
    inner = optax.adam(1e-3)
    # max_scale keeps it at the default's scale: the same grads unscale to the same values
    # (the timed step is the same but for the headroom rule and its reads of the max).
    headroom = ls.DynamicLossScale(growth="headroom", max_scale=SCALE)
    variants = {
        "bare optax.adam": (*bare_adam(inner), true_grads),
        "fused, default": (*loss_scaling_fused(inner), scaled),
        "fused, growth='headroom'": (*loss_scaling_fused(inner, scaler=headroom), scaled),
    }
    compiled, carries = {}, {}
    for name, (step, init, grads) in variants.items():
        params = jax.tree.map(jnp.copy, params0)
        opt_state = init(params)
        fn = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, grads).compile()
        compiled[name] = fn
        carry = (params, opt_state)
        for _ in range(args.warmup):  # past the headroom window's fill phase
            carry = fn(*carry, grads)
        carries[name] = jax.block_until_ready(carry)
    modes = MODES
    times = interleaved(compiled, carries, variants, args.rounds, args.steps)
    n = sum(x.size for x in jax.tree.leaves(params0))
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} "
          f"params={n / 1e6:.3f}M leaves={len(params0)} rounds={args.rounds} "
          f"steps/round={args.steps}")
    print("| variant | vs default fused, block every step | pipelined | vs bare adam, "
          "block every step | pipelined |\n|---|---:|---:|---:|---:|")
    results = {}
    for name in variants:
        med = {m: statistics.median(times[m][name]) for m in modes}
        fused = {m: statistics.median(times[m]["fused, default"]) for m in modes}
        bare = {m: statistics.median(times[m]["bare optax.adam"]) for m in modes}
        results[name] = {m: med[m] / fused[m] for m in modes}
        print(f"| {name} | {med['sync'] / fused['sync']:.3f}x | "
              f"{med['pipelined'] / fused['pipelined']:.3f}x | "
              f"{med['sync'] / bare['sync']:.2f}x | {med['pipelined'] / bare['pipelined']:.2f}x |")
    return results


if __name__ == "__main__":
    main()
