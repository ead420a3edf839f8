"""scale / unscale / all_finite over pytrees: dtype rules, edge-case trees, eager and jit."""

from __future__ import annotations

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scaling as ls

MAYBE_JIT = pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])


def enable_x64() -> contextlib.AbstractContextManager:
    """float64 for the duration of a ``with`` block, whichever spelling this JAX has."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64 as experimental_enable_x64  # older JAX

    return experimental_enable_x64()


SCALERS = [ls.StaticLossScale(2.0**15), ls.DynamicLossScale()]
SCALER_IDS = ["static", "dynamic"]
FLOAT_DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]


def dtype_id(dtype) -> str:
    return jnp.dtype(dtype).name


def bits(x) -> np.ndarray:
    return np.atleast_1d(np.asarray(x)).view(np.uint8)


def all_primitives(jaxpr) -> list[str]:
    """Every primitive name in a jaxpr, nested jaxprs included."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names.extend(all_primitives(inner))
    return names


# ----------------------------------------------------------------------------- scale


@MAYBE_JIT
@pytest.mark.parametrize("s", SCALERS, ids=SCALER_IDS)
def test_scale_float16_loss_computes_in_float32(maybe_jit, s):
    out = maybe_jit(ls.scale)(s, jnp.float16(4.0))
    assert out.dtype == jnp.float32
    assert float(out) == 131072.0          # inf if computed in float16


@MAYBE_JIT
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=dtype_id)
def test_scale_returns_at_least_float32(maybe_jit, dtype):
    x = jnp.asarray([1.5, -0.25, 0.0], dtype)
    out = maybe_jit(ls.scale)(ls.StaticLossScale(1024.0), x)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x, np.float32) * 1024.0)


@MAYBE_JIT
def test_scale_python_float_and_float64(maybe_jit):
    s = ls.StaticLossScale(8.0)
    out = maybe_jit(ls.scale)(s, 0.5)
    assert out.dtype == jnp.float32 and float(out) == 4.0
    with enable_x64():
        out = maybe_jit(ls.scale)(s, jnp.asarray(1e-300, jnp.float64))
        assert out.dtype == jnp.float64
        assert float(out) == 8e-300         # stays float64: float32 would flush to 0


@MAYBE_JIT
def test_scale_pytree_leaves_integers_untouched(maybe_jit):
    tree = {"loss": jnp.float16(2.0), "step": jnp.int32(7), "mask": jnp.array([True, False]),
            "n": [jnp.arange(3, dtype=jnp.int8)], "none": None}
    out = maybe_jit(ls.scale)(ls.StaticLossScale(4.0), tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    assert float(out["loss"]) == 8.0
    chex.assert_trees_all_equal(
        (out["step"], out["mask"], out["n"]), (tree["step"], tree["mask"], tree["n"]))
    chex.assert_trees_all_equal_dtypes(
        (out["step"], out["mask"], out["n"]), (tree["step"], tree["mask"], tree["n"]))


@MAYBE_JIT
def test_scale_is_differentiable(maybe_jit):
    s = ls.StaticLossScale(2.0**10)
    grad = maybe_jit(jax.grad(lambda w: ls.scale(s, jnp.float16(0.5) * w).astype(jnp.float32)))
    assert float(grad(jnp.float32(3.0))) == 512.0


# --------------------------------------------------------------------------- unscale


@MAYBE_JIT
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("s", SCALERS, ids=SCALER_IDS)
def test_unscale_keeps_each_leaf_dtype(maybe_jit, dtype, s):
    x = jnp.asarray([2.0**15, 3.0 * 2**14, 0.0, -(2.0**14), 1.0], dtype)
    out = maybe_jit(ls.unscale)(s, x)
    assert out.dtype == dtype
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), [1.0, 1.5, 0.0, -0.5, 2.0**-15])


@MAYBE_JIT
def test_unscale_keeps_float64(maybe_jit):
    with enable_x64():
        x = jnp.asarray([3.0 * 2**15, 1e-300], jnp.float64)
        out = maybe_jit(ls.unscale)(ls.StaticLossScale(2.0**15), x)
        assert out.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(out), [3.0, 1e-300 / 2**15])


@MAYBE_JIT
def test_unscale_mixed_tree_keeps_every_dtype(maybe_jit):
    tree = {
        "h": jnp.full((2,), 4096.0, jnp.float16),
        "b": jnp.full((3,), 4096.0, jnp.bfloat16),
        "f": jnp.full((), 4096.0, jnp.float32),
        "i": jnp.arange(4, dtype=jnp.int32),
        "flag": jnp.bool_(True),
        "masked": optax.MaskedNode(),
        "none": None,
    }
    out = maybe_jit(ls.unscale)(ls.StaticLossScale(1024.0), tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    chex.assert_trees_all_equal_dtypes(out, tree)
    for key in ("h", "b", "f"):
        np.testing.assert_array_equal(np.asarray(out[key], np.float32), 4.0)
    np.testing.assert_array_equal(out["i"], tree["i"])        # integers pass through
    assert bool(out["flag"])


@MAYBE_JIT
@pytest.mark.parametrize("exponent", [17, 30], ids=lambda e: f"2**{e}")
def test_unscale_computes_in_float32_before_casting_back(maybe_jit, exponent):
    # 2**17 is inf in float16 and 2**-30 is 0: float16 arithmetic would zero every gradient.
    x = jnp.asarray([2.0**14, 60000.0, -1.0, 6e-8], jnp.float16)   # 6e-8: float16 subnormal
    s = ls.StaticLossScale(2.0**exponent)
    out = maybe_jit(ls.unscale)(s, x)
    assert out.dtype == jnp.float16
    with np.errstate(under="ignore"):
        expected = (np.asarray(x, np.float32) / np.float32(2.0**exponent)).astype(np.float16)
    np.testing.assert_array_equal(bits(out), bits(expected))
    assert float(out[0]) == 2.0 ** (14 - exponent)        # a float16 subnormal, not 0


@MAYBE_JIT
def test_unscale_by_a_non_power_of_two_scale(maybe_jit):
    """Within rounding of the leaf's dtype, whether computed as a division or a reciprocal."""
    s = ls.StaticLossScale(3.0)
    for dtype, rtol in [(jnp.bfloat16, 2.0**-8), (jnp.float16, 2.0**-11), (jnp.float32, 2.0**-23)]:
        y = jnp.asarray([3.0, 300.0, 7.0, -1000.0], dtype)
        out = maybe_jit(ls.unscale)(s, y)
        assert out.dtype == dtype
        np.testing.assert_allclose(np.asarray(out, np.float64),
                                   np.asarray(y, np.float64) / 3.0, rtol=rtol)


@MAYBE_JIT
@pytest.mark.parametrize("exponent", [-20, -1, 0, 1, 10, 15, 24])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_unscale_of_scale_is_identity_for_power_of_two_scales(maybe_jit, exponent, dtype):
    rng = np.random.default_rng(exponent + 100)
    x = jnp.asarray(rng.normal(size=(5,)) * 8.0, dtype)
    tree = {"x": x, "y": [x[:2] * 0.5], "k": jnp.int32(3)}
    for s in (ls.StaticLossScale(2.0**exponent), ls.DynamicLossScale(init_scale=2.0**exponent)):
        out = maybe_jit(lambda st, t: ls.unscale(st, ls.scale(st, t)))(s, tree)
        # scale promotes to float32; the round trip is exact there.
        for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
            want = np.asarray(want, np.float32) if jnp.issubdtype(want.dtype, jnp.floating) \
                else np.asarray(want)
            np.testing.assert_array_equal(bits(got), bits(want))


@MAYBE_JIT
def test_unscale_of_grads_matches_unscaled_grads(maybe_jit):
    """The whole point: unscale(grad(scale(loss))) is the true float16 gradient."""
    w = jnp.asarray([1e-4, 2e-4, -3e-4], jnp.float16)

    def loss(w):
        return jnp.sum(w.astype(jnp.float32) ** 2) * 1e-3

    s = ls.StaticLossScale(2.0**15)
    scaled = maybe_jit(jax.grad(lambda w: ls.scale(s, loss(w))))(w)
    grads = maybe_jit(ls.unscale)(s, scaled)
    assert grads.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(grads, np.float32),
                               np.asarray(jax.grad(loss)(w), np.float32), rtol=1e-3)
    # Without scaling the float16 gradient underflows; with it, it does not.
    assert np.all(np.asarray(grads) != 0)


# ---------------------------------------------------------------------------- NoOp


def test_noop_scale_and_unscale_return_the_same_object():
    s = ls.NoOpLossScale()
    tree = {"a": jnp.ones(3, jnp.float16), "b": [1.0, None]}
    assert ls.scale(s, tree) is tree
    assert ls.unscale(s, tree) is tree
    x = jnp.float16(4.0)
    assert ls.scale(s, x) is x
    assert ls.unscale(s, x) is x


def test_noop_adds_no_equations():
    jaxpr = jax.make_jaxpr(
        lambda x: ls.unscale(ls.NoOpLossScale(), ls.scale(ls.NoOpLossScale(), x)))(
            jnp.ones(3, jnp.float16))
    assert jaxpr.eqns == []
    jaxpr = jax.make_jaxpr(
        lambda s, x: ls.update(s, ls.all_finite([])).loss_scale * ls.unscale(s, ls.scale(s, x)))(
            ls.NoOpLossScale(), jnp.float32(2.0))
    assert [eqn.primitive.name for eqn in jaxpr.eqns if eqn.primitive.name != "jit"] == ["mul"]


@MAYBE_JIT
def test_noop_under_jit_keeps_values_and_dtypes(maybe_jit):
    s = ls.NoOpLossScale()
    x = {"h": jnp.asarray([65504.0], jnp.float16), "i": jnp.int32(2)}
    out = maybe_jit(lambda st, t: ls.unscale(st, ls.scale(st, t)))(s, x)
    chex.assert_trees_all_equal(out, x)
    chex.assert_trees_all_equal_dtypes(out, x)


@pytest.mark.parametrize("fn", [ls.scale, ls.unscale], ids=["scale", "unscale"])
@pytest.mark.parametrize("state", [None, 2.0, {"loss_scale": 2.0}], ids=repr)
def test_scale_and_unscale_reject_non_scaler_state(fn, state):
    with pytest.raises(TypeError, match="state"):
        fn(state, jnp.ones(2))


# ------------------------------------------------------------------------- all_finite


@MAYBE_JIT
@pytest.mark.parametrize(
    "tree",
    [{}, [], (), None, [None, None], {"a": None}, optax.MaskedNode(),
     {"m": optax.MaskedNode(), "n": (None,)}],
    ids=repr)
def test_all_finite_of_empty_trees_is_true(maybe_jit, tree):
    out = maybe_jit(ls.all_finite)(tree)
    assert out.shape == () and out.dtype == jnp.bool_
    assert bool(out)


@MAYBE_JIT
def test_all_finite_ignores_integer_and_bool_leaves(maybe_jit):
    tree = {"step": jnp.int32(2**31 - 1), "count": jnp.arange(4), "flag": jnp.bool_(False),
            "u": jnp.uint8(255), "masked": optax.MaskedNode(), "w": None}
    assert bool(maybe_jit(ls.all_finite)(tree))
    # Ignored means not even looked at: no finiteness test in the compiled computation.
    assert "is_finite" not in all_primitives(jax.make_jaxpr(ls.all_finite)(tree).jaxpr)
    tree["x"] = jnp.asarray([1.0, jnp.nan], jnp.float16)
    assert not bool(maybe_jit(ls.all_finite)(tree))
    assert "is_finite" in all_primitives(jax.make_jaxpr(ls.all_finite)(tree).jaxpr)


def many_leaf_tree() -> dict:
    return {
        "h": jnp.ones((3, 2), jnp.float16),
        "b": jnp.ones((4,), jnp.bfloat16),
        "f": jnp.ones((), jnp.float32),
        "nested": [jnp.ones((2, 2), jnp.float32), {"deep": jnp.ones((5,), jnp.float16)}],
        "i": jnp.arange(3),
        "none": None,
        "masked": optax.MaskedNode(),
    }


FLOAT_PATHS = ["h", "b", "f", "nested0", "nested1"]


def poison(tree: dict, where: str, value: float) -> dict:
    tree = jax.tree.map(lambda x: x, tree)          # a fresh container, same leaves
    if where.startswith("nested"):
        index = int(where[-1])
        leaf = tree["nested"][0] if index == 0 else tree["nested"][1]["deep"]
        leaf = leaf.reshape(-1).at[-1].set(value).reshape(leaf.shape)
        if index == 0:
            tree["nested"][0] = leaf
        else:
            tree["nested"][1]["deep"] = leaf
    else:
        leaf = tree[where]
        tree[where] = leaf.reshape(-1).at[0].set(value).reshape(leaf.shape)
    return tree


@MAYBE_JIT
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", FLOAT_PATHS)
def test_all_finite_detects_one_bad_value_in_any_leaf(maybe_jit, where, value):
    tree = many_leaf_tree()
    assert bool(maybe_jit(ls.all_finite)(tree))
    bad = poison(tree, where, value)
    out = maybe_jit(ls.all_finite)(bad)
    assert out.shape == () and out.dtype == jnp.bool_
    assert not bool(out)


@MAYBE_JIT
def test_all_finite_float64_and_python_floats(maybe_jit):
    assert bool(maybe_jit(ls.all_finite)([1.0, 2.0]))
    assert not bool(maybe_jit(ls.all_finite)([1.0, float("inf")]))
    with enable_x64():
        big = jnp.asarray([1e300], jnp.float64)     # inf in float32, finite in float64
        assert bool(maybe_jit(ls.all_finite)(big))
        assert not bool(maybe_jit(ls.all_finite)(big * 1e10))


@MAYBE_JIT
def test_all_finite_sees_overflow_of_float16_largest_value(maybe_jit):
    assert bool(maybe_jit(ls.all_finite)(jnp.asarray([65504.0], jnp.float16)))
    assert not bool(maybe_jit(ls.all_finite)(jnp.asarray([65504.0], jnp.float16) * 2))


def test_all_finite_with_axis_name_agrees_across_replicas():
    grads = jnp.asarray([[1.0, 2.0], [3.0, jnp.inf], [5.0, 6.0]])
    local = jax.vmap(ls.all_finite)(grads)
    np.testing.assert_array_equal(local, [True, False, True])
    for axis_name in ("i", ("i",), ["i"]):
        reduced = jax.vmap(lambda g, a=axis_name: ls.all_finite(g, axis_name=a), axis_name="i")(
            grads)
        np.testing.assert_array_equal(reduced, [False, False, False])
    clean = jax.vmap(lambda g: ls.all_finite(g, axis_name="i"), axis_name="i")(grads[::2])
    np.testing.assert_array_equal(clean, [True, True])


def test_all_finite_feeds_update():
    s = ls.DynamicLossScale(init_scale=8.0, growth_interval=1)

    @jax.jit
    def step(s, grads):
        grads = ls.unscale(s, grads)
        return ls.update(s, ls.all_finite(grads))

    s = step(s, {"w": jnp.ones(2, jnp.float16)})
    assert float(s.loss_scale) == 16.0
    s = step(s, {"w": jnp.asarray([1.0, jnp.inf], jnp.float16)})
    assert float(s.loss_scale) == 8.0
