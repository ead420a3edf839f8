"""The states, comparisons and data the checkpoint tests share (imported as a sibling module,
like bitwise.py): scalers with non-default values in every leaf and field, optimizer states
stepped through a skip, the docs' recipe (docs/checkpoints.md's ``recipe`` block, imported:
save / restore / make_state), and the batches of the resume runs.
"""

from __future__ import annotations

import doc_blocks
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from hypothesis import strategies as st

import loss_scaling as ls
from loss_scaling import state_dict

TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)
NAN = float("nan")
INF = float("inf")
INVALID = "invalid loss-scale state dict"

MAYBE_JIT = pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])


# The recipe of docs/checkpoints.md (its `<!-- block: name=recipe -->` block): imported, it
# defines save / restore / make_state, which the checkpoint tests use; run as a program, it
# saves and resumes a state (test_checkpoint_recipe.py::test_docs_recipe_runs).
RECIPE = doc_blocks.named("checkpoints.md", "recipe")
JSON_BLOCK = doc_blocks.named("checkpoints.md", "json")


def recipe() -> dict:
    """The docs' save / restore functions (the block imported, its demo part not run)."""
    return doc_blocks.execute(RECIPE, module_name="checkpointing")


# --------------------------------------------------------------------------- comparisons


def as_bytes(x) -> np.ndarray:
    return np.asarray(x).reshape(-1).view(np.uint8)


def assert_bit_identical(a, b, same_treedef=True):
    """Same leaves bit for bit (dtype, shape, bytes); same treedef (configs included).

    A Python scalar leaf (a TrainState's initial ``step``) counts as the array JAX makes of it.
    """
    if same_treedef:
        assert jax.tree.structure(a) == jax.tree.structure(b)
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        x, y = (np.asarray(jnp.asarray(v) if isinstance(v, (int, float)) else v) for v in (x, y))
        assert (x.dtype, x.shape) == (y.dtype, y.shape), jax.tree_util.keystr(path)
        assert np.array_equal(as_bytes(x), as_bytes(y)), jax.tree_util.keystr(path)


def host_copy(tree):
    """A numpy copy, safe from donation."""
    return jax.tree.map(np.array, tree)


# --------------------------------------------------------------- scalers, by kind

# Non-default in every field, and float32 values that are not short decimals.
CUSTOM_CONFIG = dict(
    growth_factor=float(np.float32(1.1)),
    backoff_factor=float(np.float32(0.3)),
    growth_interval=5,
    hysteresis=3,
    min_scale=float(np.float32(0.1)),
    max_scale=2.0**20 + 1.0,
)
CONFIG_FIELDS = tuple(CUSTOM_CONFIG)


def config_of(s) -> dict:
    if isinstance(s, ls.DynamicLossScale):
        return {name: getattr(s, name) for name in CONFIG_FIELDS}
    return {}


def dynamic_after_clean_steps() -> ls.DynamicLossScale:
    """Scale 1000.1 grown by 1.1, backed off by 0.3 (~330, not a short decimal);
    growth_tracker 3."""
    s = ls.DynamicLossScale(init_scale=float(np.float32(1000.1)), **CUSTOM_CONFIG)
    for finite in [True] * 5 + [False] * 3 + [True] * 3:
        s = ls.update(s, finite)
    assert int(s.growth_tracker) == 3 and int(s.nonfinite_tracker) == 0
    return s


def dynamic_after_overflows() -> ls.DynamicLossScale:
    """nonfinite_tracker 2 (one short of a backoff)."""
    s = dynamic_after_clean_steps()
    s = ls.update(ls.update(s, False), False)
    assert int(s.growth_tracker) == 0 and int(s.nonfinite_tracker) == 2
    return s


def dynamic_both_trackers() -> ls.DynamicLossScale:
    """Both trackers non-default at once (unreachable by `update`, but a valid state). A
    failed state's round trip is tested in test_transform.py."""
    s = dynamic_after_clean_steps()
    return jax.tree.unflatten(
        jax.tree.structure(s), [s.loss_scale, jnp.int32(4), jnp.int32(3), jnp.int32(0)])


STATES = {
    "noop": ls.NoOpLossScale,
    "static": lambda: ls.StaticLossScale(float(np.float32(3.3e4))),
    "dynamic_clean": dynamic_after_clean_steps,
    "dynamic_overflows": dynamic_after_overflows,
    "dynamic_both": dynamic_both_trackers,
}
ALL_STATES = pytest.mark.parametrize("make", list(STATES.values()), ids=list(STATES))


def saved_state() -> ls.DynamicLossScale:
    """growth_interval 5 with growth_tracker 3; hysteresis 3 (values from the config)."""
    return dynamic_after_clean_steps()


def target(**changes) -> ls.DynamicLossScale:
    return ls.DynamicLossScale(init_scale=1.0 if "min_scale" not in changes else
                               changes["min_scale"], **{**CUSTOM_CONFIG, **changes})


# ------------------------------------------------------- state dicts, corrupted


def base_dict() -> dict:
    return state_dict(dynamic_after_clean_steps())   # scale ~330, trackers (3, 0)


DELETE = object()


def corrupt(path: tuple, value) -> dict:
    d = base_dict()
    node = d
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


# ------------------------------------------------------------ in optimizer states


def scalers():
    """Each kind with non-default values in every leaf."""
    dynamic = ls.DynamicLossScale(init_scale=1000.0, growth_interval=5, hysteresis=3,
                                  min_scale=2.0, growth_factor=3.0, backoff_factor=0.25)
    for finite in (True, True, False, True, True, True, True, True, False):
        dynamic = ls.update(dynamic, finite)
    assert int(dynamic.growth_tracker) == 0 and int(dynamic.nonfinite_tracker) == 1
    dynamic = ls.update(ls.update(dynamic, True), True)  # growth_tracker 2, streak reset
    return {"noop": ls.NoOpLossScale(), "static": ls.StaticLossScale(96.0), "dynamic": dynamic}


SCALER_KINDS = pytest.mark.parametrize("kind", ["noop", "static", "dynamic"])
PARAMS = {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.array([0.5, -0.0])}


def chained(scaler):
    """The wrapper around an optax.chain of adamw and a schedule with its own state (the
    wrapper outermost: a schedule chained after it would count skipped steps, and is
    refused by ls.check / ls.metrics)."""
    return ls.with_loss_scaling(optax.chain(
        optax.adamw(1e-2),
        optax.scale_by_schedule(lambda count: 1.0 / (1.0 + 0.1 * count)),
    ), scaler)


def stepped_chain_state(scaler, poison=(1.0, INF, 1.0)):
    tx = chained(scaler)
    params, opt_state = PARAMS, tx.init(PARAMS)
    for p in poison:
        grads = jax.tree.map(lambda x, p=p: (x + 1.0) * p, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return tx, params, opt_state


# ------------------------------------------------------ optimizer states, stepped


def linen_state():
    tx = ls.with_loss_scaling(optax.adamw(1e-2), ls.DynamicLossScale(
        init_scale=512.0, growth_interval=3, hysteresis=2))
    return train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)


def ls_state():
    tx = ls.with_loss_scaling(optax.adamw(1e-2), ls.DynamicLossScale(
        init_scale=512.0, growth_interval=3, hysteresis=2))
    return ls.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)


def dict_state():
    tx = chained(ls.DynamicLossScale(init_scale=512.0, growth_interval=3, hysteresis=2))
    return {"params": PARAMS, "opt_state": tx.init(PARAMS)}


def stepped(state):
    grads = [jax.tree.map(lambda x, p=p: (x - 1.0) * p, PARAMS) for p in (1.0, INF, 1.0)]
    if isinstance(state, dict):
        tx = chained(ls.DynamicLossScale(init_scale=512.0, growth_interval=3, hysteresis=2))
        for g in grads:
            updates, opt_state = tx.update(g, state["opt_state"], state["params"])
            state = {"params": optax.apply_updates(state["params"], updates),
                     "opt_state": opt_state}
        return state
    for g in grads:
        state = state.apply_gradients(grads=g)
    return state


ORBAX_STATES = pytest.mark.parametrize("make", [linen_state, ls_state, dict_state],
                                       ids=["linen", "ls", "dict"])


# ----------------------------------------------------- the resume runs' batches

N_STEPS, RESUME_AT = 30, 16
OVERFLOW_STEPS = frozenset({2, 3, 4, 9, 15, 16, 22, 23, 24})
VARIANTS = ("plain", "fused", "ls_train_state", "flax_train_state")


def batches():
    """(x, y, poison) for every step; poison is inf on the steps that overflow."""
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(N_STEPS, 16, 4)).astype(np.float32)
    ys = rng.normal(size=(N_STEPS, 16, 1)).astype(np.float32)
    poison = np.array([INF if t in OVERFLOW_STEPS else 1.0 for t in range(N_STEPS)],
                      np.float32)
    return [(jnp.asarray(xs[t]), jnp.asarray(ys[t]), jnp.asarray(poison[t]))
            for t in range(N_STEPS)]


# ------------------------------------------------ junk for the hypothesis searches

json_scalars = (st.none() | st.booleans() | st.integers() | st.text(max_size=8)
                | st.floats())
junk = st.recursive(
    json_scalars,
    lambda children: (st.lists(children, max_size=3)
                      | st.dictionaries(st.text(max_size=5), children, max_size=3)
                      | st.tuples(children)),
    max_leaves=8,
)
