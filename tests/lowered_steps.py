"""Prints the lowered text of the default steps (fused, fused with loss=, plain, TrainState,
nnx, Equinox; interval and headroom scalers), for comparing two versions of the package.

A refactor that claims "no change to the compiled step" diffs this output (issue 41):

    PYTHONPATH=OLD python tests/lowered_steps.py > old.txt
    PYTHONPATH=NEW python tests/lowered_steps.py > new.txt
    diff old.txt new.txt

SSA names are renumbered and source locations dropped, so only the program differs.
"""
import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import loss_scaling as ls


def scalers():
    return {"interval": ls.DynamicLossScale(init_scale=2.0**10, growth_interval=4),
            "headroom": ls.DynamicLossScale(init_scale=2.0**10, growth="headroom",
                                            headroom_window=4)}


def clean(text):
    # source locations hold the checkout's path and line numbers: not the program
    text = re.sub(r'loc\(.*?\)\n', '\n', text)
    text = re.sub(r'#loc\d* = loc\(.*\)', '', text)
    text = re.sub(r' loc\(#loc\d*\)', '', text)
    # value names and block labels are numbered in order: renumbering is not a change
    text = re.sub(r'%[A-Za-z_]*\d+(#\d+)?', '%v', text)
    return re.sub(r'\^bb\d+', '^bb', text)


def emit(name, lowered):
    print(f"===== {name}")
    print(clean(lowered.as_text()))


params = {"w": jnp.ones((64, 32), jnp.float32), "b": jnp.zeros((32,), jnp.float32),
          "small": jnp.ones((3,), jnp.float32)}
grads = jax.tree.map(lambda x: x * 2.0, params)

def emit_steps(kind: str, scaler: ls.DynamicLossScale) -> None:
    tx = ls.with_loss_scaling(optax.adam(1e-3), scaler)
    opt_state = tx.init(params)
    emit(f"fused {kind}", jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p)).lower(
        grads, opt_state, params))
    emit(f"fused+loss {kind}", jax.jit(
        lambda g, s, p, loss: ls.apply_gradients(tx, g, s, p, loss=loss)).lower(
        grads, opt_state, params, jnp.float32(1.0)))

    def plain(g, s, p):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s
    emit(f"plain {kind}", jax.jit(plain).lower(grads, opt_state, params))

    state = ls.TrainState.create(apply_fn=None, params=params, tx=tx)
    emit(f"TrainState {kind}", jax.jit(
        lambda st, g: st.apply_gradients(grads=g)).lower(state, grads))

    model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    optimizer = ls.nnx.Optimizer(model, tx, wrt=nnx.Param)

    def nnx_step(model, optimizer, x):
        _, g = ls.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(optimizer, model)
        optimizer.update(model, g)
    graphdef, st = nnx.split((model, optimizer))

    def pure_nnx(st, x):
        m, o = nnx.merge(graphdef, st)
        nnx_step(m, o, x)
        return nnx.state((m, o))
    emit(f"nnx {kind}", jax.jit(pure_nnx).lower(st, jnp.ones((4, 16))))

    emodel = eqx.nn.Linear(16, 8, key=jax.random.key(0))
    eopt = tx.init(eqx.filter(emodel, eqx.is_inexact_array))

    def eqx_step(model, opt_state, x):
        _, g = ls.value_and_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(opt_state, model)
        return ls.equinox.apply_gradients(tx, g, opt_state, model)
    emit(f"equinox {kind}", eqx.filter_jit(eqx_step).lower(emodel, eopt, jnp.ones((4, 16))))


if __name__ == "__main__":
    print("loss_scaling from", ls.__file__, file=sys.stderr)
    for kind, scaler in scalers().items():
        emit_steps(kind, scaler)
