"""Exact at every valid state: the skip decision and the unscale, for every dtype and scale.

One definition of a finite step holds everywhere: a step is applied iff every element of
every floating (real or complex) gradient leaf, unscaled exactly as ``ls.unscale`` computes
it, is finite. The reference here is independent of the library: numpy's float64 product of
``x`` and the float32 reciprocal of the scale (numpy keeps subnormals), rounded to float32,
then cast to the leaf's dtype (``ml_dtypes`` for bfloat16 and float8); float64 leaves in
float64. The library must give the same bits wherever that reference is a normal number or
zero (XLA on CPU flushes subnormal results to zero, which the docs say). PyTorch's CPU
kernels are a second, differential reference (tests/test_torch_reference.py).
"""

from __future__ import annotations

import functools
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from bitwise import assert_bit_identical, bits
from hypothesis import example, given, settings
from hypothesis import strategies as st

import loss_scaling as ls
from loss_scaling.core import numerics as ls_tree

F32 = np.finfo(np.float32)
# Gradient and params trees in every float dtype on purpose: bfloat16 params warn at init
# (tested in test_diagnostics.py).
pytestmark = pytest.mark.filterwarnings(
    r"ignore:with_loss_scaling. the params .* are b?float16:UserWarning")

NAN, INF = float("nan"), float("inf")
MAYBE_JIT = pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
PATHS = pytest.mark.parametrize("path", ["plain", "fused"])

REAL_DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2,
               jnp.float8_e4m3fnuz, jnp.float8_e3m4, jnp.float4_e2m1fn]
DTYPES = [*REAL_DTYPES, jnp.complex64]


# ------------------------------------------------------------------------ the reference


def reciprocal32(scale: float) -> np.float64:
    """float32(1 / scale), rounded once, as PyTorch's GradScaler computes it (numpy keeps
    the subnormal)."""
    with np.errstate(all="ignore"):
        return np.float64(np.float32(1.0 / np.float64(np.float32(scale))))


def reference_real(x: np.ndarray, scale: float, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(unscaled in the leaf's dtype, the float32 product before the cast)."""
    with np.errstate(all="ignore"):
        if np.dtype(dtype) == np.float64:
            product = x.astype(np.float64) * reciprocal32(scale)
            return product, product
        product = (x.astype(np.float64) * reciprocal32(scale)).astype(np.float32)
        return product.astype(dtype), product


def make_complex(re: np.ndarray, im: np.ndarray, dtype) -> np.ndarray:
    """Part by part: ``re + 1j * im`` would turn an infinite part into NaN."""
    out = np.zeros(np.shape(re), dtype)
    out.real, out.imag = re, im
    return out


def reference(x: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    if np.iscomplexobj(x):
        part = np.float64 if x.dtype == np.complex128 else np.float32
        (re, pre), (im, pim) = (reference_real(p, scale, part) for p in (x.real, x.imag))
        return make_complex(re, im, x.dtype), make_complex(pre, pim, x.dtype)
    return reference_real(x, scale, x.dtype)


def comparable(x: np.ndarray, product: np.ndarray) -> np.ndarray:
    """Where the library must match the reference bit for bit: the float32 product is
    normal or zero, and the input is not a float32 subnormal (both are flushed on CPU)."""
    def part(v: np.ndarray, p: np.ndarray) -> np.ndarray:
        tiny = np.finfo(np.float64 if p.dtype == np.float64 else np.float32).tiny
        v = v.astype(np.float64)
        return ~((np.abs(p) < tiny) & (p != 0)) & ~((np.abs(v) < tiny) & (v != 0))
    if np.iscomplexobj(product):
        return part(x.real, product.real) & part(x.imag, product.imag)
    return part(x, product)


def same_bits(got: np.ndarray, want: np.ndarray, where: np.ndarray) -> bool:
    """Bitwise equality where ``where``; NaN matches NaN (payloads may differ)."""
    got, want = np.asarray(got), np.asarray(want)
    if np.iscomplexobj(want):
        return (same_bits(got.real, want.real, where) and same_bits(got.imag, want.imag, where))
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    both_nan = np.isnan(got64) & np.isnan(want64)
    equal = (got.view(np.uint8).reshape(got.shape + (-1,))
             == want.view(np.uint8).reshape(want.shape + (-1,))).all(-1)
    return bool(np.all(~where | both_nan | equal))


def all_finite_reference(x: np.ndarray, scale: float) -> bool:
    unscaled, _ = reference(x, scale)
    if np.iscomplexobj(unscaled):
        return bool(np.isfinite(unscaled.real).all() and np.isfinite(unscaled.imag).all())
    return bool(np.isfinite(unscaled.astype(np.float64)).all())


# ----------------------------------------------------------------------------- strategies


def extremes(dtype) -> list[float]:
    info = ml_dtypes.finfo(dtype) if dtype not in (np.float32, np.float64) else np.finfo(dtype)
    smallest_subnormal = float(getattr(info, "smallest_subnormal", 0.0) or 0.0)
    values = [float(info.max), -float(info.max), float(info.tiny), smallest_subnormal, 0.0,
              -0.0, 1.0, -1.5, 3.0, 1e-3, 7e4, 1e30, NAN, INF, -INF]
    return values


scales = st.one_of(
    st.integers(-126, 127).map(lambda e: 2.0**e),                       # powers of two
    st.floats(2.0**126, float(F32.max), width=32),                       # reciprocal subnormal
    st.floats(float(F32.tiny), float(F32.max), width=32),                # anything valid
    st.sampled_from([1.0, 0.999, 3.0, 2.0**15, 1e-30, float(F32.max), float(F32.tiny)]),
)


@st.composite
def leaves(draw, dtypes=DTYPES):
    dtype = draw(st.sampled_from(dtypes))
    size = draw(st.integers(1, 6))
    part = np.float32 if dtype == jnp.complex64 else np.float64 if dtype == jnp.complex128 \
        else dtype

    def values() -> np.ndarray:
        pool = extremes(part)
        picks = [draw(st.sampled_from(pool)) * draw(st.sampled_from([1.0, 1.0, 0.75, 2.0**-10]))
                 for _ in range(size)]
        with np.errstate(all="ignore"):
            return np.asarray(np.asarray(picks, np.float64), np.dtype(part))

    if dtype in (jnp.complex64, jnp.complex128):
        return make_complex(values(), values(), dtype)
    return values()


trees = st.lists(leaves(), min_size=1, max_size=4).map(
    lambda xs: {f"leaf{i}": x for i, x in enumerate(xs)})


# ------------------------------------------------------------------- unscale, exactly


def check_unscale(tree: dict, scale: float, unscale) -> None:
    got = unscale(ls.StaticLossScale(scale), jax.tree.map(jnp.asarray, tree))
    for name, x in tree.items():
        want, product = reference(x, scale)
        assert np.asarray(got[name]).dtype == x.dtype, name
        assert same_bits(got[name], want, comparable(x, product)), (
            f"{name}: scale {scale!r}, x {x!r}: got {np.asarray(got[name])!r}, want {want!r}")


@settings(max_examples=25, deadline=None)
@given(tree=trees, scale=scales)
@example(tree={"x": np.asarray([2.0**127, 3e38, 1.0], np.float32)}, scale=2.0**127)
@example(tree={"x": np.asarray([65440.0], np.float16)}, scale=0.999)
def test_unscale_matches_the_float64_reference(tree, scale):
    check_unscale(tree, scale, ls.unscale)
    check_unscale(tree, scale, jax.jit(ls.unscale))


def test_unscale_above_2_126_is_not_flushed_to_zero():
    """1/scale is subnormal there; XLA on CPU would flush it (every gradient -> 0)."""
    for maybe_jit in (lambda f: f, jax.jit):
        got = maybe_jit(ls.unscale)(ls.StaticLossScale(2.0**127), jnp.float32(2.0**127))
        assert float(got) == 1.0
        s = float(np.float32(3e38))
        x = np.asarray([3e38, 1e38, 5e36], np.float32)
        want, _ = reference(x, s)
        assert np.array_equal(np.asarray(maybe_jit(ls.unscale)(ls.StaticLossScale(s), x)), want)
    # Also when the scale is a compile-time constant, which XLA could fold.
    constant = jax.jit(lambda g: ls.unscale(ls.StaticLossScale(2.0**127), g))
    assert float(constant(jnp.float32(2.0**127))) == 1.0


def test_the_reciprocal_is_rounded_once_for_every_scale_above_2_126():
    rng = np.random.default_rng(0)
    scales_ = np.concatenate([
        rng.uniform(2.0**126, float(F32.max), 50_000).astype(np.float32),
        np.nextafter(np.float32(2.0**126), np.float32(np.inf), dtype=np.float32)[None],
        np.asarray([2.0**126, 2.0**127, F32.max], np.float32)])
    inverse = jax.jit(jax.vmap(ls_tree.reciprocal))(jnp.asarray(scales_))
    value = np.asarray(inverse.lifted, np.float64) * np.asarray(inverse.unlift, np.float64)
    want = np.asarray([reciprocal32(s) for s in scales_])
    np.testing.assert_array_equal(value, want)


# ---------------------------------------------------- one definition of a finite step


def plain(tx):
    def step(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return updates, opt_state
    return step


@settings(max_examples=10, deadline=None)
@given(tree=trees, scale=scales)
@example(tree={"x": np.asarray([1e38] * 4, np.float32)}, scale=1.0)
@example(tree={"x": np.asarray([65440.0, 1.0], np.float16)}, scale=0.999)
@example(tree={"x": np.asarray([1 + 2j, np.nan], np.complex64)}, scale=2.0**15)
# A one-entry complex leaf with both parts near float32's max: XLA once factored the
# bounded sum's two terms into one overflowing sum (found by this test).
@example(tree={"x": np.asarray([3.4028235e38 + 3.4028235e38j], np.complex64)}, scale=1.0)
def test_the_wrapper_decides_exactly_as_all_finite_of_unscale(tree, scale):
    """Wrapper, ``ls.all_finite(ls.unscale(...))`` and the reference agree; an applied step
    hands the inner optimizer the unscaled gradients; a skipped one changes nothing."""
    grads = jax.tree.map(jnp.asarray, tree)
    want = all(all_finite_reference(x, scale) for x in tree.values())
    s = ls.StaticLossScale(scale)
    assert bool(ls.all_finite(ls.unscale(s, grads))) == want
    tx = ls.with_loss_scaling(optax.identity(), s)
    opt_state = tx.init(grads)
    for step in (plain(tx), jax.jit(plain(tx))):
        updates, new_state = step(grads, opt_state, grads)
        assert bool(new_state.last_step_applied) == want, (tree, scale)
        expected = ls.unscale(s, grads) if want else jax.tree.map(
            lambda g: jnp.full_like(g, -0.0), grads)
        assert_bit_identical(bits(expected), updates)
        flags = np.asarray(new_state.nonfinite_grads)
        assert flags.tolist() == [not all_finite_reference(x, scale) for x in tree.values()]


small_group_trees = st.lists(leaves(), min_size=1, max_size=8).map(
    lambda xs: {f"leaf{i}": x for i, x in enumerate(xs)})


@settings(max_examples=8, deadline=None)  # each example compiles two steps
@given(tree=small_group_trees, scale=scales)
@example(tree={f"leaf{i}": np.asarray([1.0, 2.0, 3.0], np.float32) for i in range(5)}
         | {"leaf5": np.asarray([1.0, np.inf, 3.0, 4.0, 5.0], np.float32)}, scale=2.0**15)
def test_grouped_small_leaves_are_flagged_leaf_by_leaf(tree, scale):
    """The CPU step tests small leaves concatenated, per dtype (``tree.leaf_groups``).
    With tiny thresholds the same trees mix joined groups, full groups that spill into a
    new one and large single leaves: the decision and every per-leaf flag still equal the
    reference, on the plain and the fused path."""
    grads = jax.tree.map(jnp.asarray, tree)
    flags_want = [not all_finite_reference(x, scale) for x in tree.values()]
    s = ls.StaticLossScale(scale)
    tx = ls.with_loss_scaling(optax.identity(), s)
    with mock.patch.object(ls_tree, "SMALL_LEAF", 4), \
            mock.patch.object(ls_tree, "GROUP_ENTRIES", 9):
        groups = ls_tree.leaf_groups(jax.tree.leaves(grads))
        assert sorted(i for g in groups for i in g.indices) == list(range(len(tree)))
        fused = functools.partial(ls.apply_gradients, tx)
        for step in (jax.jit(plain(tx)), jax.jit(fused)):  # (eager: the test above)
            _, new_state = step(grads, tx.init(grads), grads)
            assert bool(new_state.last_step_applied) == (not any(flags_want)), (tree, scale)
            assert np.asarray(new_state.nonfinite_grads).tolist() == flags_want


def test_leaf_groups_join_small_leaves_of_one_dtype_up_to_the_cap():
    f32, f16 = jnp.float32, jnp.float16
    sizes = [3, 5000, 3, 0, 4096, 4097, 2]
    leaves = [jnp.ones((n,), f32) for n in sizes] + [jnp.ones((2,), f16), jnp.int32(3)]
    groups = ls_tree.leaf_groups(leaves)
    # Small float32 leaves together (the empty one is in no group), float16 apart, the
    # two larger than SMALL_LEAF (4096) on their own, the integer leaf nowhere.
    assert groups == [ls_tree.LeafGroup((1,), False), ls_tree.LeafGroup((5,), False),
                      ls_tree.LeafGroup((0, 2, 4, 6), True), ls_tree.LeafGroup((7,), True)]
    many = [jnp.ones((4000,), f32) for _ in range(40)]  # 160,000 entries
    joined = ls_tree.leaf_groups(many)
    assert [len(g.indices) for g in joined] == [16, 16, 8]
    assert all(sum(many[i].size for i in g.indices) <= ls_tree.GROUP_ENTRIES for g in joined)


def test_sums_that_overflow_no_longer_skip_finite_steps():
    """sum(|g|) used to decide: four entries of 1e38 read as non-finite at any scale."""
    tx = ls.with_loss_scaling(optax.sgd(1e-40), ls.DynamicLossScale(init_scale=1.0))
    for grads in (jnp.full((4,), 1e38), jnp.full((1_000_000,), 3.5e32)):
        params = jnp.zeros_like(grads)
        opt_state = tx.init(params)
        for step in (plain(tx), jax.jit(plain(tx))):
            _, new_state = step(grads, opt_state, params)
            assert bool(new_state.last_step_applied)
            assert float(new_state.scaler.loss_scale) == 1.0


def test_a_float16_leaf_that_rounds_to_65504_is_finite():
    s = ls.StaticLossScale(0.999)
    g = jnp.asarray([65440.0], jnp.float16)
    assert float(ls.unscale(s, g)[0]) == 65504.0
    tx = ls.with_loss_scaling(optax.identity(), s)
    _, state = tx.update(g, tx.init(g), g)
    assert bool(state.last_step_applied)


@PATHS
def test_a_scale_above_2_126_trains_on_the_true_gradient(path):
    """Such scales are valid (growth reaches them from 2**126): Adam must see 1.0, not 0."""
    inner = optax.adam(0.1)
    tx = ls.with_loss_scaling(inner, ls.StaticLossScale(2.0**127))
    params = jnp.ones(3)
    opt_state = tx.init(params)
    grads = jnp.full(3, 2.0**127)            # the gradient 1.0, scaled by 2**127
    if path == "fused":
        new_params, opt_state = jax.jit(functools.partial(ls.apply_gradients, tx))(
            grads, opt_state, params)
    else:
        updates, opt_state = jax.jit(tx.update)(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
    want_updates, _ = inner.update(jnp.ones(3), inner.init(params), params)
    want = optax.apply_updates(params, want_updates)
    assert float(want[0]) < 0.95           # it moved: the gradient was not flushed to zero
    chex.assert_trees_all_close(new_params, want, rtol=1e-6)   # XLA fuses Adam its own way


# ------------------------------------------------------------------- complex and float8


@PATHS
def test_complex_gradients_are_checked_and_unscaled(path):
    tx = ls.with_loss_scaling(optax.sgd(1.0), ls.StaticLossScale(2.0**15))
    params = jnp.asarray([1 + 1j, 2 - 1j], jnp.complex64)
    opt_state = tx.init(params)

    def step(grads, opt_state, params):
        if path == "fused":
            return ls.apply_gradients(tx, grads, opt_state, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(step)
    bad = jnp.asarray([complex(NAN, 0.0), 1 + 0j], jnp.complex64) * 2.0**15
    new_params, state = step(bad, opt_state, params)
    assert_bit_identical(bits(params), new_params)
    assert int(state.skipped_steps) == 1
    inf_imag = jnp.asarray([complex(0.0, INF), 0j], jnp.complex64)
    new_params, state = step(inf_imag, opt_state, params)
    assert int(state.skipped_steps) == 1
    good = jnp.asarray([0.5 + 0.25j, -1j], jnp.complex64) * 2.0**15
    new_params, state = step(good, opt_state, params)
    chex.assert_trees_all_equal(new_params, params - jnp.asarray([0.5 + 0.25j, -1j]))


@pytest.mark.parametrize("dtype", REAL_DTYPES[3:], ids=lambda d: jnp.dtype(d).name)
@MAYBE_JIT
def test_float8_and_float4_leaves_scale_unscale_and_step(maybe_jit, dtype):
    s = ls.StaticLossScale(4.0)
    g = jnp.asarray([1.0, 2.0, -0.5], dtype)
    scaled = maybe_jit(ls.scale)(s, g)
    assert scaled.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(scaled), np.asarray(g, np.float32) * 4.0)
    unscaled = maybe_jit(ls.unscale)(s, g)
    assert unscaled.dtype == dtype
    want, _ = reference(np.asarray(g), 4.0)
    assert same_bits(unscaled, want, np.ones(3, bool))
    tx = ls.with_loss_scaling(optax.identity(), s)
    updates, state = maybe_jit(tx.update)(g, tx.init(g), g)
    assert bool(state.last_step_applied)
    assert same_bits(updates, want, np.ones(3, bool))


# ------------------------------------------------------------------- extra arguments


def rosenbrock(p):
    return jnp.sum(100.0 * (p[1:] - p[:-1] ** 2) ** 2 + (1.0 - p[:-1]) ** 2)


@PATHS
def test_lbfgs_sees_the_unscaled_grad_extra_argument(path):
    """optax.lbfgs's line search reads ``grad=``: it must be unscaled (and checked) too."""
    inner = optax.lbfgs()
    tx = ls.with_loss_scaling(inner, ls.StaticLossScale(1024.0))
    params0 = jnp.asarray([-1.2, 1.0, 0.5])

    @jax.jit
    def reference_step(params, state):
        value, grad = jax.value_and_grad(rosenbrock)(params)
        updates, state = inner.update(grad, state, params, value=value, grad=grad,
                                      value_fn=rosenbrock)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def scaled_step(params, state):
        value, grad = ls.value_and_grad(rosenbrock)(state, params)     # grad scaled by 1024
        kwargs = dict(value=value, grad=grad, value_fn=rosenbrock)
        if path == "fused":
            return ls.apply_gradients(tx, grad, state, params, **kwargs)
        updates, state = tx.update(grad, state, params, **kwargs)
        return optax.apply_updates(params, updates), state

    p_ref, s_ref = params0, inner.init(params0)
    p, s = params0, tx.init(params0)
    for _ in range(80):
        p_ref, s_ref = reference_step(p_ref, s_ref)
        p, s = scaled_step(p, s)
    if path == "fused":   # XLA compiles it like the reference: the same bits
        chex.assert_trees_all_equal(p, p_ref)
    assert float(rosenbrock(p)) < 1e-6    # (the plain program rounds differently; L-BFGS on
    # Rosenbrock amplifies ulps along the way, but converges all the same)
    # A non-finite grad= alone skips the step.
    bad = {"value": rosenbrock(p), "grad": jnp.asarray([NAN, 0.0, 0.0]), "value_fn": rosenbrock}
    _, state = tx.update(jax.grad(rosenbrock)(p) * 1024.0, s, p, **bad)
    assert not bool(state.last_step_applied)


def test_the_inner_optimizer_receives_grad_unscaled_and_other_extra_args_untouched():
    def update(updates, state, params=None, grad=None, value=None, **extra):
        return grad * value, state           # shows what it was given

    spy = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
    tx = ls.with_loss_scaling(spy, ls.StaticLossScale(1024.0))
    params = jnp.ones(2)
    grads = jnp.asarray([1024.0, -2048.0])
    extra = {"grad": grads, "value": jnp.float32(3.0)}       # grad unscaled, value as given
    updates, _ = tx.update(grads, tx.init(params), params, **extra)
    np.testing.assert_array_equal(updates, [3.0, -6.0])
    new_params, _ = ls.apply_gradients(tx, grads, tx.init(params), params, **extra)
    np.testing.assert_array_equal(new_params, [4.0, -5.0])


def test_lookahead_diagnostics_are_sized_and_named_by_the_gradients():
    tx = ls.with_loss_scaling(optax.lookahead(optax.sgd(0.1), sync_period=2,
                                              slow_step_size=0.5))
    params = optax.LookaheadParams.init_synced({"a": jnp.ones(2), "b": jnp.ones(3)})
    opt_state = tx.init(params)
    assert opt_state.nonfinite_grads.shape == (2,)
    for b in (jnp.ones(3), jnp.asarray([1.0, NAN, 1.0])):
        _, opt_state = jax.jit(tx.update)({"a": jnp.ones(2), "b": b}, opt_state, params)
    assert ls.nonfinite_grad_paths(opt_state, params) == ["b"]
    with pytest.raises(ValueError, match="the gradients have 1 leaves but this optimizer state "
                                         "was initialised for 2"):
        tx.update({"a": jnp.ones(2)}, opt_state, params)


# ------------------------------------------------------------------------------- float64


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@settings(max_examples=12, deadline=None)
@given(tree=st.lists(leaves([np.float64, jnp.complex128, jnp.float32]), min_size=1,
                     max_size=3).map(lambda xs: {f"leaf{i}": x for i, x in enumerate(xs)}),
       scale=scales)
def test_float64_leaves_unscale_in_float64(tree, scale):
    with jax.enable_x64(True):
        check_unscale(tree, scale, jax.jit(ls.unscale))
        grads = jax.tree.map(jnp.asarray, tree)
        want = all(all_finite_reference(x, scale) for x in tree.values())
        tx = ls.with_loss_scaling(optax.identity(), ls.StaticLossScale(scale))
        _, state = jax.jit(tx.update)(grads, tx.init(grads), grads)
        assert bool(state.last_step_applied) == want


@pytest.mark.usefixtures("x64")
def test_float64_subnormal_params_on_a_skipped_step():
    """Documented: the fused path returns params itself (bit-identical); the plain path's
    ``p + -0.0`` runs on a backend that flushes subnormals (XLA on CPU), so a float64
    subnormal param reads as zero there. Normal params are bit-identical on both."""
    tx = ls.with_loss_scaling(optax.sgd(1.0))
    params = jnp.asarray([5e-324, 1e-310, 1.0, -0.0], jnp.float64)
    opt_state = tx.init(params)
    bad = jnp.asarray([NAN, 0.0, 0.0, 0.0], jnp.float64)
    fused, _ = jax.jit(functools.partial(ls.apply_gradients, tx))(bad, opt_state, params)
    assert_bit_identical(bits(params), fused)
    updates, _ = jax.jit(tx.update)(bad, opt_state, params)
    plain_params = np.asarray(jax.jit(optax.apply_updates)(params, updates))
    assert_bit_identical(bits(params[2:]), plain_params[2:])
    if jax.default_backend() == "cpu":
        assert plain_params[:2].tolist() == [0.0, 0.0]
