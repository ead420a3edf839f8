"""Compile time of a whole train step (forward, backward, update), loss scaling against bare.

Where the user waits: the first call of a jitted train step traces, lowers and compiles the
forward pass, the backward pass and the update together. The model is a GPT in flax linen
(``--layers`` blocks of pre-LayerNorm attention with separate q/k/v projections and an MLP;
12 layers are 197 parameter leaves), float16 compute, float32 params, ``flax`` /
``ls.TrainState`` donated, Adam. Each variant is compiled interleaved, round after round,
with ``jax.clear_caches()`` before every compile, so machine noise hits them all alike; the
table gives the median seconds of tracing + lowering, of XLA's compile, and of both, and the
ratio of the total to the bare step's.

    python benchmarks/train_step_compile.py                     # 12 layers, 3 rounds
    python benchmarks/train_step_compile.py --layers 4 --rounds 5
    python benchmarks/train_step_compile.py --counts   # what XLA compiled, no timing

``--counts`` prints, instead of times, what the compiled program holds: its kernels (XLA
fusions), HLO instructions and conditionals. On a busy machine compile times swing by 2x
between runs; these counts are the same on every run and follow compile time (on XLA CPU
each kernel is a function that LLVM compiles), so a change can be judged by them first.

The variants:

* ``bare``: ``jax.value_and_grad`` of the loss, flax's ``TrainState.apply_gradients``.
* ``hand guard``: the least a loss-scaled step can be, written by hand: the loss times a
  constant, one sum-of-squares screen of the gradients concatenated, one ``lax.cond``
  around unscale + Adam + apply.
* ``optax.apply_if_finite``: the loss times a constant, the gradients unscaled by hand, then
  optax's guard (the plain optax contract: updates leave the guard).
* ``ls fused``: the default recipe of docs/linen.md: ``ls.value_and_grad`` and
  ``ls.TrainState.apply_gradients(grads=, loss=)``.
* ``ls plain``: flax's own ``TrainState`` with ``ls.with_loss_scaling`` (``tx.update`` then
  ``apply_updates``).
* ``ls headroom``: the fused step with ``growth="headroom"``.
* ``ls max_replays=2``: the fused step with replay, ``value_fn=`` passed (it traces the
  loss and its gradient twice).
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import loss_scaling as ls

SCALE = 2.0**15
DTYPE = jnp.float16


class Block(nn.Module):
    width: int
    heads: int
    dtype: Any = DTYPE  # the compute dtype (flax's convention); params stay float32
    residual_dtype: Any = None  # the writes into the residual stream (None: dtype)

    @nn.compact
    def __call__(self, x):
        batch, length, width = x.shape
        head = width // self.heads
        dtype = self.dtype
        residual = self.residual_dtype or dtype
        h = nn.LayerNorm(dtype=dtype)(x)
        q, k, v = (nn.Dense(width, dtype=dtype, name=name)(h).reshape(
            batch, length, self.heads, head) for name in ("query", "key", "value"))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head).astype(dtype)
        causal = jnp.tril(jnp.ones((length, length), bool))
        logits = jnp.where(causal, logits, jnp.finfo(dtype).min)
        weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(dtype)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width)
        x = x + nn.Dense(width, dtype=residual, name="out")(attended)
        h = nn.LayerNorm(dtype=dtype)(x)
        h = nn.Dense(4 * width, dtype=dtype)(h)
        return x + nn.Dense(width, dtype=residual)(nn.gelu(h))


class GPT(nn.Module):
    """``dtype=jnp.float32`` is the same model written in float32 (every cast above is then
    a no-op): benchmarks/autocast_cost.py runs it under ``ls.autocast``."""

    layers: int
    vocab: int = 256
    width: int = 64
    heads: int = 4
    length: int = 32
    dtype: Any = DTYPE
    residual_dtype: Any = None  # the residual stream's (None: dtype; autocast_policy_cost.py)

    @nn.compact
    def __call__(self, tokens):
        residual = self.residual_dtype or self.dtype
        x = nn.Embed(self.vocab, self.width, dtype=residual)(tokens)
        x = x + nn.Embed(self.length, self.width, dtype=residual)(
            jnp.arange(tokens.shape[1]))
        for _ in range(self.layers):
            x = Block(self.width, self.heads, self.dtype, self.residual_dtype)(x)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(self.vocab, use_bias=False, dtype=self.dtype)(x)


def cross_entropy(model: GPT, params: Any, tokens: jax.Array) -> jax.Array:
    logits = model.apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


Step = Callable[[Any, jax.Array], Any]


def variants(model: GPT) -> dict[str, tuple[Step, Callable[[Any], Any]]]:
    """Each variant: a train step ``(state, tokens) -> state`` and how to build its state."""
    adam = optax.adam(1e-3)
    loss_of = functools.partial(cross_entropy, model)

    def flax_state(tx):
        return lambda params: train_state.TrainState.create(apply_fn=None, params=params,
                                                            tx=tx)

    def ls_state(tx):
        return lambda params: ls.TrainState.create(apply_fn=None, params=params, tx=tx)

    def bare(state, tokens):
        grads = jax.grad(loss_of)(state.params, tokens)
        return state.apply_gradients(grads=grads)

    def hand_guard(state, tokens):
        grads = jax.grad(lambda p: loss_of(p, tokens) * SCALE)(state.params)
        leaves = jax.tree.leaves(grads)
        joined = jnp.concatenate([g.ravel() for g in leaves])
        finite = jnp.isfinite(jnp.sum(jnp.square(joined)))

        def step(operands):
            params, opt_state, grads = operands
            grads = jax.tree.map(lambda g: g * (1.0 / SCALE), grads)
            updates, opt_state = adam.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        params, opt_state = jax.lax.cond(finite, step, lambda ops: (ops[0], ops[1]),
                                         (state.params, state.opt_state, grads))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state)

    if_finite = optax.apply_if_finite(adam, max_consecutive_errors=10**6)

    def apply_if_finite(state, tokens):
        grads = jax.grad(lambda p: loss_of(p, tokens) * SCALE)(state.params)
        grads = jax.tree.map(lambda g: g * (1.0 / SCALE), grads)
        return state.apply_gradients(grads=grads)

    def ls_fused(state, tokens):
        loss, grads = ls.value_and_grad(loss_of)(state, state.params, tokens)
        return state.apply_gradients(grads=grads, loss=loss)

    def ls_plain(state, tokens):  # flax's TrainState: tx.update, then apply_updates
        loss, grads = ls.value_and_grad(loss_of)(state, state.params, tokens)
        return state.apply_gradients(grads=grads)

    def ls_replay(state, tokens):
        loss, grads = ls.value_and_grad(loss_of)(state, state.params, tokens)
        return state.apply_gradients(grads=grads, loss=loss,
                                     value_fn=lambda p: loss_of(p, tokens))

    return {
        "bare": (bare, flax_state(adam)),
        "hand guard": (hand_guard, flax_state(adam)),
        "optax.apply_if_finite": (apply_if_finite, flax_state(if_finite)),
        "ls fused": (ls_fused, ls_state(ls.with_loss_scaling(adam))),
        "ls plain": (ls_plain, flax_state(ls.with_loss_scaling(adam))),
        "ls headroom": (ls_fused, ls_state(ls.with_loss_scaling(
            adam, ls.DynamicLossScale(growth="headroom")))),
        "ls max_replays=2": (ls_replay, ls_state(ls.with_loss_scaling(adam,
                                                                      max_replays=2))),
    }


def compile_once(step: Step, state: Any, tokens: Any) -> tuple[float, float]:
    """Seconds to trace and lower, and to compile, with every JAX cache cleared first."""
    jax.clear_caches()
    start = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=0).lower(state, tokens)
    traced = time.perf_counter()
    lowered.compile()
    return traced - start, time.perf_counter() - traced


def measure(layers: int, rounds: int, names: list[str] | None = None
            ) -> tuple[int, dict[str, list[tuple[float, float]]]]:
    model = GPT(layers)
    tokens = jnp.zeros((4, model.length + 1), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1])["params"]
    table = variants(model)
    table = {name: table[name] for name in (names or table)}
    states = {name: jax.eval_shape(make, params) for name, (_, make) in table.items()}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in table}
    for _ in range(rounds):
        for name, (step, _) in table.items():
            times[name].append(compile_once(step, states[name], tokens))
    return len(jax.tree.leaves(params)), times


def counts(layers: int, names: list[str] | None = None) -> str:
    """Kernels, HLO instructions and conditionals of each variant's compiled step."""
    model = GPT(layers)
    tokens = jnp.zeros((4, model.length + 1), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1])["params"]
    table = variants(model)
    lines = [f"GPT, {layers} layers ({len(jax.tree.leaves(params))} param leaves): what "
             "the compiled step holds",
             f"{'variant':24s} {'kernels':>8s} {'/ bare':>7s} {'HLO instr':>10s} "
             f"{'/ bare':>7s} {'conds':>6s}"]
    base: tuple[int, int] | None = None
    for name in names or table:
        step, make = table[name]
        state = jax.eval_shape(make, params)
        hlo = jax.jit(step, donate_argnums=0).lower(state, tokens).compile().as_text()
        kernels = hlo.count("kind=k")  # kLoop, kInput, kOutput fusions
        instructions = len(re.findall(r"^\s+(?:ROOT )?%?[\w.-]+ = ", hlo, re.M))
        base = base or (kernels, instructions)
        lines.append(f"{name:24s} {kernels:8d} {kernels / base[0]:7.2f} {instructions:10d} "
                     f"{instructions / base[1]:7.2f} {hlo.count(' conditional('):6d}")
    return "\n".join(lines)


def report(layers: int, leaves: int, times: dict[str, list[tuple[float, float]]]) -> str:
    total = {name: statistics.median(t + c for t, c in runs) for name, runs in times.items()}
    base = total.get("bare", next(iter(total.values())))
    rounds = len(next(iter(times.values())))
    lines = [f"GPT, {layers} layers ({leaves} param leaves), float16 compute, float32 params, "
             f"Adam, donated; median of {rounds} compiles, jax.clear_caches() before each",
             f"{'variant':24s} {'trace+lower s':>13s} {'compile s':>10s} {'total s':>8s} "
             f"{'/ bare':>7s}"]
    for name, runs in times.items():
        trace = statistics.median(t for t, _ in runs)
        comp = statistics.median(c for _, c in runs)
        lines.append(f"{name:24s} {trace:13.2f} {comp:10.2f} {total[name]:8.2f} "
                     f"{total[name] / base:7.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--counts", action="store_true",
                        help="print the compiled programs' kernel and instruction counts "
                             "(deterministic) instead of timing compiles")
    parser.add_argument("--only", nargs="+", default=None, metavar="VARIANT",
                        help="measure these variants only (names as in the table)")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    for layers in args.layers:
        if args.counts:
            print(counts(layers, args.only), flush=True)
            print()
            continue
        leaves, times = measure(layers, args.rounds, args.only)
        print(report(layers, leaves, times), flush=True)
        print()


if __name__ == "__main__":
    main()
