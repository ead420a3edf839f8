"""What keeping a forward overflow in float32 costs: ``report.policy`` against the default
autocast program and against the hand-written fix.

The model is the GPT of ``benchmarks/train_step_compile.py`` written in float32, with a
"massive activation" planted as large language models grow them: the first position
carries a feature (channel 5 of its position embedding) that one hidden unit of block 0's
MLP detects, and that unit writes ~2e5 into channel 3 of the residual stream, past
float16's 65,504. Three programs of ``jax.jit(jax.value_and_grad(loss))``:

* ``autocast``: ``ls.autocast`` with the default policy (its loss is NaN: the overflow;
  the time is what the program costs, the reference of the ratios);
* ``autocast + policy``: with ``report.policy`` of ``ls.autocast_report`` on one batch (the
  MLP's down projection accumulates and returns float32);
* ``hand fix``: the model hand-cast to float16 (flax's ``dtype=``) with the whole residual
  stream in float32: the embeddings, and the two projections that write into it, in
  float32 (``GPT(residual_dtype=jnp.float32)``).

Measured side by side in one process, interleaved, with autocast_cost.py's harness.

    python benchmarks/autocast_policy_cost.py              # 12 layers
    python benchmarks/autocast_policy_cost.py --layers 4 --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from autocast_cost import compile_once, loss_of, rotated, time_steps  # noqa: E402
from train_step_compile import GPT  # noqa: E402

import loss_scaling as ls  # noqa: E402

REFERENCE = "autocast"


def planted(layers: int, batch: int) -> tuple[Any, jax.Array]:
    """float32 params with the massive activation, and a batch of tokens."""
    model = GPT(layers, dtype=jnp.float32)
    tokens = jax.random.randint(jax.random.key(1), (batch, model.length + 1), 0, model.vocab)
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
    params = jax.tree.map(lambda x: x, params)  # a mutable copy of the nested dicts
    params["Embed_1"]["embedding"] = params["Embed_1"]["embedding"].at[0, 5].set(12.0)
    up, down = params["Block_0"]["Dense_0"], params["Block_0"]["Dense_1"]
    up["kernel"] = up["kernel"].at[:, 0].set(0.0).at[5, 0].set(10.0)
    up["bias"] = up["bias"].at[0].set(-30.0)
    _, state = model.apply({"params": params}, tokens[:, :-1], capture_intermediates=True,
                           mutable=["intermediates"])
    unit = jax.nn.gelu(state["intermediates"]["Block_0"]["Dense_0"]["__call__"][0][:, 0, 0])
    down["kernel"] = down["kernel"].at[0, :].set(0.0).at[0, 3].set(2e5 / float(unit.min()))
    return params, tokens


def gradient_fns(layers: int, policy: ls.AutocastPolicy) -> dict[str, Callable[[], Any]]:
    full = loss_of(GPT(layers, dtype=jnp.float32))
    hand = loss_of(GPT(layers, dtype=jnp.float16, residual_dtype=jnp.float32))
    return {
        REFERENCE: lambda: jax.value_and_grad(ls.autocast(full)),
        "autocast + policy": lambda: jax.value_and_grad(ls.autocast(full, policy=policy)),
        "hand fix": lambda: jax.value_and_grad(hand),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 5 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 5
    params, tokens = planted(args.layers, args.batch)
    report = ls.autocast_report(loss_of(GPT(args.layers, dtype=jnp.float32)), params, tokens)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; GPT {args.layers} layers, "
          f"batch {args.batch}; report.policy keeps {len(report.policy.float32_out)} "
          f"equation(s) in float32: {[s.path for s in report.policy.float32_out]}")
    makes = gradient_fns(args.layers, report.policy)
    compiled: dict[str, Any] = {}
    results: dict[str, dict[str, list[float]]] = {n: {"block": [], "piped": []} for n in makes}
    for name in makes:
        compiled[name] = compile_once(makes[name], params, tokens)[2]
    for k in range(args.rounds):
        for name in rotated(list(compiled), k):
            results[name]["block"].append(time_steps(compiled[name], params, tokens,
                                                     args.steps, True))
            results[name]["piped"].append(time_steps(compiled[name], params, tokens,
                                                     args.steps, False))
    med = statistics.median
    ref = results[REFERENCE]
    print(f"{'variant':18s} {'loss':>8s} {'block ms':>9s} {'/ autocast':>11s} "
          f"{'pipelined ms':>13s} {'/ autocast':>11s} {'temp MiB':>9s}")
    for name, r in results.items():
        loss = float(compiled[name](params, tokens)[0])
        temp = compiled[name].memory_analysis().temp_size_in_bytes / 2**20
        print(f"{name:18s} {loss:8.4f} {1e3 * med(r['block']):9.2f} "
              f"{med(r['block']) / med(ref['block']):11.2f} {1e3 * med(r['piped']):13.2f} "
              f"{med(r['piped']) / med(ref['piped']):11.2f} {temp:9.2f}")
    assert not np.isfinite(float(compiled[REFERENCE](params, tokens)[0])), "nothing planted"


if __name__ == "__main__":
    main()
