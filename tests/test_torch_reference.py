"""Differential test against PyTorch's CPU grad-scaling kernels (``torch.amp.GradScaler``).

PyTorch's ``GradScaler`` does one step with two kernels, and this file runs both next to the
library on random inputs:

* ``torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``, with
  ``inv_scale = scale.double().reciprocal().float()`` exactly as ``GradScaler.unscale_``
  computes it: ``ls.unscale`` gives the same bits, and the wrapper skips the same steps;
* ``torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor,
  backoff_factor, growth_interval)``: ``ls.update`` of a ``DynamicLossScale`` gives the same
  scale bits and growth tracker at every step;
* a whole step, ``ls.with_loss_scaling(optax.sgd(1.0), ...)`` against GradScaler's
  ``unscale_`` then ``optimizer.step()`` with ``torch.optim.SGD(lr=1.0)``.

What differs, on purpose or by backend:

* **The skip decision (on purpose).** PyTorch tests the *scaled* gradients for inf/NaN; the
  library tests the *unscaled* ones. They differ exactly where unscaling overflows (a scale
  below 1 and a large finite gradient): PyTorch then applies an infinite update, the
  library skips the step. So ``our_skip == (torch_found_inf or any(not isfinite(torch's
  unscaled values)))``.
* **Fail closed (on purpose).** Where PyTorch's backoff takes the scale into float32
  subnormals (and on to zero), the library records ``ls.Failure.BACKOFF_UNDERFLOW`` and keeps
  the last valid scale; ``ls.check`` raises.
* **Subnormals (the backend).** XLA on CPU flushes float32 subnormals to zero, on input and
  on output, and it flushes a float32 product whose exact value is below the smallest normal
  *before* rounding it. So the unscaled values are compared wherever PyTorch's result is a
  normal number, zero, inf or NaN, the input is not a float32 subnormal (a float32 or
  bfloat16 subnormal gradient reads as zero), and the exact float32 product is not below the
  smallest normal float32 (PyTorch rounds a product within half a subnormal step below it up
  to the smallest normal; XLA on CPU gives zero). The tests at the end show each case.

``GradScaler`` itself refuses float16 gradients (``allow_fp16=False`` in ``step``), so the
random whole-step test calls its two kernels and ``torch.optim.SGD`` directly, in
``GradScaler.step``'s order; one scripted test runs the real ``torch.amp.GradScaler``.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from bitwise import assert_bit_identical, bits
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

import loss_scaling as ls

# bfloat16 params on purpose (the kernels' dtypes); the warning: tests/test_diagnostics.py
pytestmark = pytest.mark.filterwarnings("ignore:with_loss_scaling. the params:UserWarning")

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed", allow_module_level=True)


class _Torch:
    """``torch``, imported on first use: collecting this file (on every xdist worker)
    does not import it, only running its tests does."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)


torch = _Torch()

F32 = np.finfo(np.float32)
TINY, F32_MAX = float(F32.tiny), float(F32.max)
NAN, INF = float("nan"), float("inf")
DTYPES = [np.float16, jnp.bfloat16, np.float32]


# ------------------------------------------------------------------- torch <-> numpy


def to_torch(x: np.ndarray):
    """A bit-exact torch copy of a float16 / bfloat16 / float32 numpy array."""
    if x.dtype == jnp.bfloat16:
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def to_numpy(t) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16).copy()
    return t.numpy().copy()


def torch_inv_scale(scale: float):
    """``GradScaler.unscale_``'s reciprocal: in float64, rounded once to float32."""
    return torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()


def torch_unscale(tree: dict, scale: float) -> tuple[dict, bool]:
    """PyTorch's kernel on copies of ``tree``: (unscaled leaves, found_inf)."""
    tensors = {k: to_torch(v) for k, v in tree.items()}
    found_inf = torch.zeros((), dtype=torch.float32)
    inv_scale = torch_inv_scale(scale)
    for dtype in {t.dtype for t in tensors.values()}:   # GradScaler groups by dtype
        group = [t for t in tensors.values() if t.dtype == dtype]
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
    return {k: to_numpy(t) for k, t in tensors.items()}, bool(found_inf.item())


def torch_update_scale(scale, tracker, finite: bool, s: ls.DynamicLossScale) -> None:
    """``GradScaler.update``: PyTorch's kernel, in place, with the scaler's own factors.

    The library holds its factors as float32 values (``s.backoff_factor`` is ``0.5``, or
    ``float32(0.3)`` for a requested 0.3); PyTorch multiplies by the float64 factor it is
    given, so it gets the same float32 ones.
    """
    found_inf = torch.tensor(0.0 if finite else 1.0, dtype=torch.float32)
    torch._amp_update_scale_(scale, tracker, found_inf, s.growth_factor, s.backoff_factor,
                             s.growth_interval)


# ----------------------------------------------------------------------- comparisons


def as_f64(x) -> np.ndarray:
    with np.errstate(all="ignore"):      # signalling NaN patterns warn when cast
        return np.asarray(x, np.float64)


def f32_subnormal(x: np.ndarray) -> np.ndarray:
    v = np.abs(as_f64(x))
    return (v != 0) & (v < TINY)


def exact_product(x: np.ndarray, scale: float) -> np.ndarray:
    """x times PyTorch's float32 reciprocal, exactly (a float32 times a float32 fits in a
    float64 mantissa)."""
    with np.errstate(all="ignore"):
        return as_f64(x) * np.float64(torch_inv_scale(scale).item())


def not_subnormal(out: np.ndarray) -> np.ndarray:
    """Where a result is normal, zero, inf or NaN in its own dtype."""
    v = np.abs(as_f64(out))
    return ~((v != 0) & (v < float(ml_dtypes.finfo(out.dtype).tiny)))


def flushed_on_cpu(exact: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Where the exact float32 result is subnormal but PyTorch's is not zero: PyTorch keeps
    it (or rounds it up to the smallest normal); XLA on CPU flushes it to zero first."""
    return f32_subnormal(exact) & (as_f64(out) != 0)


def comparable(x: np.ndarray, torch_out: np.ndarray, scale: float) -> np.ndarray:
    """Where ``ls.unscale`` must give PyTorch's bits: PyTorch's result is normal, zero, inf
    or NaN in its dtype; the input is not a float32 subnormal; the exact product is not a
    float32 subnormal that PyTorch kept or rounded up to the smallest normal."""
    return (not_subnormal(torch_out) & ~f32_subnormal(x)
            & ~flushed_on_cpu(exact_product(x, scale), torch_out))


def same_bits(got, want: np.ndarray, where: np.ndarray) -> bool:
    """Bit equality where ``where`` (NaN matches any NaN: payloads may differ)."""
    got, want = np.ascontiguousarray(np.asarray(got)), np.ascontiguousarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    both_nan = np.isnan(as_f64(got)) & np.isnan(as_f64(want))
    width = want.dtype.itemsize
    equal = (got.view(np.uint8).reshape(-1, width) == want.view(np.uint8).reshape(-1, width))
    return bool(np.all(~where.reshape(-1) | both_nan.reshape(-1) | equal.all(-1)))


def f32_bits(x) -> int:
    return int(np.asarray(x, np.float32).view(np.uint32))


# ------------------------------------------------------------------------ strategies


def extremes(dtype) -> list[float]:
    info = ml_dtypes.finfo(dtype)
    return [float(info.max), -float(info.max), float(info.tiny), -float(info.tiny),
            float(info.smallest_subnormal), -float(info.smallest_subnormal), 0.0, -0.0, 1.0,
            -1.5, 3.0, 1e-3, 65504.0, 7e4, 1e30, -3e38, NAN, INF, -INF]


scales = st.one_of(
    st.integers(-126, 127).map(lambda e: 2.0**e),                              # powers of two
    st.floats(2.0**126, F32_MAX, width=32, exclude_min=True),                   # 1/s subnormal
    st.floats(TINY, float(np.float32(1e-30)), width=32),                        # tiny
    st.floats(TINY, F32_MAX, width=32),                                         # any valid
    st.sampled_from([0.5, 0.999, 1.0, 3.0, 2.0**15, 1e5, TINY, F32_MAX]),
)


@st.composite
def arrays(draw, dtype, size, finite_only=False):
    pool = [v for v in extremes(dtype) if not finite_only or np.isfinite(v)]
    value = st.one_of(st.sampled_from(pool), st.floats(width=32, allow_nan=not finite_only,
                                                        allow_infinity=not finite_only))
    picks = [draw(value) * draw(st.sampled_from([1.0, 1.0, 0.75, 2.0**-10]))
             for _ in range(size)]
    with np.errstate(all="ignore"):
        out = np.asarray(np.asarray(picks, np.float64), dtype)
    if finite_only:
        out[~np.isfinite(out.astype(np.float64))] = 0
    return out


LEAF_SIZE = 4


@st.composite
def gradient_trees(draw):
    """One leaf per dtype, of one fixed shape (so that nothing recompiles between examples);
    each leaf is finite or not at random, so that both decisions are common."""
    return {jnp.dtype(d).name: draw(arrays(d, LEAF_SIZE, finite_only=draw(st.booleans())))
            for d in DTYPES}


# -------------------------------------------------- unscaled values and skip decisions


def plain_update(tx):
    def step(grads, opt_state, params):
        return tx.update(grads, opt_state, params)
    return step


def with_scale(tx, params, scale: float):
    """``tx.init(params)`` with its static scale set to ``scale``: the scale is a leaf, so
    one transformation (and one compiled step) serves every example."""
    return tx.init(params)._replace(scaler=ls.StaticLossScale(scale))


IDENTITY = ls.with_loss_scaling(optax.identity(), ls.StaticLossScale(1.0))
IDENTITY_STEPS = (plain_update(IDENTITY), jax.jit(plain_update(IDENTITY)))


SGD = ls.with_loss_scaling(optax.sgd(1.0), ls.StaticLossScale(1.0))


def sgd_plain(grads, opt_state, params):
    updates, opt_state = SGD.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


SGD_FUSED = functools.partial(ls.apply_gradients, SGD)
SGD_STEPS = (("plain", sgd_plain), ("fused", SGD_FUSED), ("plain-jit", jax.jit(sgd_plain)),
             ("fused-jit", jax.jit(SGD_FUSED)))


def fixed_tree(**leaves) -> dict:
    """A tree of :func:`gradient_trees`' shape: the given values, the rest ones."""
    tree = {jnp.dtype(d).name: np.ones(LEAF_SIZE, d) for d in DTYPES}
    for name, values in leaves.items():
        tree[name][: len(values)] = values
    return tree


OVERFLOWS_IN_UNSCALING = fixed_tree(float32=[3e38, -1.0])
ROUNDS_TO_FLOAT16_INF = fixed_tree(float16=[65440.0, -1.0])


@settings(max_examples=40, deadline=None)
@given(tree=gradient_trees(), scale=scales)
@example(tree=OVERFLOWS_IN_UNSCALING, scale=0.5)
@example(tree=ROUNDS_TO_FLOAT16_INF, scale=0.9)
@example(tree=fixed_tree(float32=[3e38, 1e-40, NAN]), scale=2.0**127)
@example(tree=fixed_tree(bfloat16=[1.5, -0.0, 3e38]), scale=float(F32.max))
@example(tree=fixed_tree(float16=[65504.0] * LEAF_SIZE, bfloat16=[3.3895e38] * LEAF_SIZE,
                         float32=[F32_MAX] * LEAF_SIZE), scale=1.0)   # sums past max: finite
def test_unscale_and_skip_decision_match_torchs_kernel(tree, scale):
    """``ls.unscale`` gives PyTorch's bits (where comparable, see the module docstring), and
    a step is skipped iff PyTorch's kernel found a non-finite scaled gradient or its own
    unscaled result is non-finite (the one documented difference)."""
    want, found_inf = torch_unscale(tree, scale)
    s = ls.StaticLossScale(scale)
    grads = jax.tree.map(jnp.asarray, tree)
    for unscale in (ls.unscale, jax.jit(ls.unscale)):
        got = unscale(s, grads)
        for k, x in tree.items():
            where = comparable(x, want[k], scale)
            assert same_bits(got[k], want[k], where), (
                f"{k}: scale {scale!r}, x {x!r}: got {np.asarray(got[k])!r}, torch {want[k]!r}")

    torch_nonfinite_output = any(not np.isfinite(as_f64(v)).all()
                                 for v in want.values())
    expected_skip = found_inf or torch_nonfinite_output
    event("skipped" if expected_skip else "applied")
    if expected_skip != found_inf:
        event("the one difference: unscaling overflowed where torch found no inf")
    opt_state = with_scale(IDENTITY, grads, scale)
    for step in IDENTITY_STEPS:
        _, new_state = step(grads, opt_state, grads)
        our_skip = not bool(new_state.last_step_applied)
        assert our_skip == expected_skip, (tree, scale, found_inf)
        assert our_skip or not found_inf              # torch's skips are a subset of ours
    assert (not bool(ls.all_finite(ls.unscale(s, grads)))) == expected_skip


EXHAUSTIVE_SCALES = [2.0**15, 3000.0, 0.999, 2.0**-10, 1.7e5, 2.0**127 * 1.3, F32_MAX, TINY]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_16_bit_value_unscales_to_torchs_bits(dtype):
    """All 65536 float16 / bfloat16 bit patterns (65536 random float32 ones) at fixed scales,
    eagerly and under ``jit``. Every float16 result matches, subnormal results included."""
    if np.dtype(dtype).itemsize == 2:
        x = np.arange(2**16, dtype=np.uint16).view(dtype)
    else:
        x = np.random.default_rng(0).integers(0, 2**32, 2**16, dtype=np.uint32).view(np.float32)
    for scale in EXHAUSTIVE_SCALES:
        want, _ = torch_unscale({"x": x}, scale)
        # float16: every value. No float16 input is a float32 subnormal, and a product that
        # is one rounds to a float16 zero in PyTorch too.
        where = np.ones(x.shape, bool) if dtype == np.float16 else comparable(x, want["x"], scale)
        for unscale in (ls.unscale, jax.jit(ls.unscale)):
            got = unscale(ls.StaticLossScale(scale), jnp.asarray(x))
            assert same_bits(got, want["x"], where), scale


def test_the_one_difference_occurs_where_unscaling_overflows():
    """PyTorch checks the scaled gradients: 3e38 at scale 0.5 is finite, so it applies the
    unscaled inf (and 65440 at scale 0.9 rounds to float16 inf); the library skips."""
    for tree, scale, leaf in ((OVERFLOWS_IN_UNSCALING, 0.5, "float32"),
                              (ROUNDS_TO_FLOAT16_INF, 0.9, "float16")):
        params = fixed_tree()
        torch_params, unscaled, found_inf = torch_sgd_step(params, tree, scale)
        assert not found_inf                                # torch steps ...
        assert np.isinf(as_f64(unscaled[leaf][0]))
        assert np.isinf(as_f64(torch_params[leaf][0]))   # ... into an inf param
        grads = jax.tree.map(jnp.asarray, tree)
        opt_state = with_scale(SGD, grads, scale)
        for name, step in SGD_STEPS:
            new_params, new_state = step(grads, opt_state, jax.tree.map(jnp.asarray, params))
            assert not bool(new_state.last_step_applied), name
            assert int(new_state.skipped_steps) == 1
            assert_bit_identical(bits(params), new_params)


def test_where_xla_flushes_subnormals_and_torch_does_not():
    """The excluded cases, pinned down: a float32 subnormal gradient reads as zero on CPU,
    and a product just below the smallest normal, which PyTorch rounds up to it, is flushed
    to zero (XLA on CPU flushes before rounding). Everywhere else the bits are PyTorch's."""
    below = float(np.nextafter(np.float32(2.0**-125), np.float32(0)))   # 2*tiny - 2**-149
    cases = [
        # (gradient, scale): torch's result, then what XLA on CPU may give instead.
        (np.asarray([1e-40], np.float32), 2.0**-20),      # subnormal input, normal output
        (np.asarray([below], np.float32), 2.0),            # exact product tiny - 2**-150
    ]
    for x, scale in cases:
        want, _ = torch_unscale({"g": x}, scale)
        assert abs(float(want["g"][0])) >= TINY            # torch: a normal number
        assert not comparable(x, want["g"], scale).any()
        for unscale in (ls.unscale, jax.jit(ls.unscale)):
            got = np.asarray(unscale(ls.StaticLossScale(scale), jnp.asarray(x)))
            if jax.default_backend() == "cpu":
                assert got[0] == 0.0
            assert got[0] in (0.0, want["g"][0])


# ------------------------------------------------------------------------ scale sequence


def rounds_up_to_tiny(old: float, backoff: float) -> bool:
    """PyTorch's backoff product is below the smallest normal but rounds up to it."""
    exact = np.float64(np.float32(old)) * np.float64(backoff)
    return exact < TINY and float(np.float32(exact)) == TINY


def check_failed_closed(ours: ls.DynamicLossScale, before: ls.DynamicLossScale) -> None:
    assert int(ours.failure) == ls.Failure.BACKOFF_UNDERFLOW
    assert f32_bits(ours.loss_scale) == f32_bits(before.loss_scale)     # last valid value
    assert float(ours.loss_scale) >= TINY
    with pytest.raises(ls.LossScaleError, match="loss scale backoff failed"):
        ls.check(ours)


factors = st.one_of(st.just(2.0), st.sampled_from([1.5, 3.0, 4.0, 1.0001]),
                    st.floats(1.0001, 16.0))
backoffs = st.one_of(st.just(0.5), st.sampled_from([0.25, 0.9, 0.125]),
                     st.floats(0.01, 0.99))
init_scales = st.one_of(st.integers(-126, 127).map(lambda e: 2.0**e),
                        st.floats(TINY, F32_MAX, width=32),
                        st.floats(TINY, float(np.float32(1e-36)), width=32),
                        st.floats(float(np.float32(1e37)), F32_MAX, width=32))


@settings(max_examples=30, deadline=None)
@given(init_scale=init_scales, growth_factor=factors, backoff_factor=backoffs,
       growth_interval=st.integers(1, 4), flags=st.lists(st.booleans(), max_size=40))
@example(init_scale=2.0**-124, growth_factor=2.0, backoff_factor=0.5, growth_interval=1,
         flags=[False] * 4)
@example(init_scale=2.0**126, growth_factor=2.0, backoff_factor=0.5, growth_interval=1,
         flags=[True] * 4 + [False, True, True])
@example(init_scale=2.0**15, growth_factor=2.0, backoff_factor=0.3, growth_interval=2,
         flags=[True, True, False, True, True, True, False, False, True, True])
def test_scale_sequence_matches_torchs_update_kernel(init_scale, growth_factor,
                                                     backoff_factor, growth_interval, flags):
    """Every step's scale bits and growth tracker, eagerly and under ``jit``, against
    ``torch._amp_update_scale_``. The run is compared while PyTorch's scale stays normal;
    at the first backoff that would leave the normal range the library fails closed."""
    s0 = ls.DynamicLossScale(init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval)
    torch_scale = torch.tensor(float(s0.loss_scale), dtype=torch.float32)
    torch_tracker = torch.zeros((), dtype=torch.int32)
    eager = jitted = s0
    update_jit = jax.jit(ls.update)
    for finite in flags:
        old = float(torch_scale.item())
        torch_update_scale(torch_scale, torch_tracker, finite, s0)
        new = float(torch_scale.item())
        if not new >= TINY or rounds_up_to_tiny(old, s0.backoff_factor):
            # torch: subnormal or zero (or rounded up from below the normal range).
            event("torch's backoff left the normal float32 range")
            assert not finite
            with pytest.raises(ls.LossScaleError, match="loss scale backoff failed"):
                ls.update(eager, finite)
            after = update_jit(jitted, finite)
            if int(after.failure) == ls.Failure.NONE:      # a backend that rounds first
                assert f32_bits(after.loss_scale) == f32_bits(new)
            else:
                check_failed_closed(after, jitted)
            return
        eager = ls.update(eager, finite)
        jitted = update_jit(jitted, finite)
        for ours in (eager, jitted):
            assert f32_bits(ours.loss_scale) == f32_bits(new), (old, finite, new, ours)
            assert int(ours.growth_tracker) == int(torch_tracker.item())
            assert int(ours.failure) == ls.Failure.NONE


@pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_where_torch_backs_off_into_subnormals_we_fail_closed(maybe_jit):
    """PyTorch halves 2**-126 to the subnormal 2**-127 and on to zero; the library records
    BACKOFF_UNDERFLOW at that step, keeps 2**-126, and never changes again."""
    s = ls.DynamicLossScale(init_scale=2.0**-125, growth_interval=1)
    torch_scale = torch.tensor(2.0**-125, dtype=torch.float32)
    torch_tracker = torch.zeros((), dtype=torch.int32)
    torch_update_scale(torch_scale, torch_tracker, False, s)
    s = ls.update(s, False)
    assert float(s.loss_scale) == float(torch_scale.item()) == TINY
    ls.check(s)                                         # healthy: returns None

    torch_update_scale(torch_scale, torch_tracker, False, s)
    assert 0 < float(torch_scale.item()) < TINY         # torch: subnormal
    if maybe_jit is jax.jit:
        failed = jax.jit(ls.update)(s, False)
        check_failed_closed(failed, s)
        for finite in (False, False, True):             # sticky
            torch_update_scale(torch_scale, torch_tracker, finite, s)
            failed = jax.jit(ls.update)(failed, finite)
            check_failed_closed(failed, s)
        assert float(torch_scale.item()) == 2.0**-128   # torch moved on regardless
    else:
        with pytest.raises(ls.LossScaleError, match="below the smallest normal float32"):
            ls.update(s, False)


def test_a_backoff_that_rounds_up_to_the_smallest_normal():
    """2*tiny - 2**-149 times 0.5 is tiny - 2**-150: PyTorch rounds it to tiny (normal) and
    goes on; XLA on CPU flushes the product before rounding, so the library fails closed
    there. Either outcome is allowed; a silent zero or subnormal scale is not."""
    below = float(np.nextafter(np.float32(2.0**-125), np.float32(0)))
    s = ls.DynamicLossScale(init_scale=below)
    torch_scale = torch.tensor(below, dtype=torch.float32)
    torch_update_scale(torch_scale, torch.zeros((), dtype=torch.int32), False, s)
    assert float(torch_scale.item()) == TINY and rounds_up_to_tiny(below, 0.5)
    after = jax.jit(ls.update)(s, False)
    if jax.default_backend() == "cpu":
        check_failed_closed(after, s)
    assert f32_bits(after.loss_scale) in (f32_bits(TINY), f32_bits(below))


# ---------------------------------------------------------------------- a whole step


def torch_sgd_step(params: dict, grads: dict, scale: float) -> tuple[dict, dict, bool]:
    """``GradScaler.step`` with ``SGD(lr=1.0)``: unscale the grads with PyTorch's kernel;
    step unless it found an inf/NaN. Returns (new params, unscaled grads, found_inf)."""
    ps = {k: to_torch(v) for k, v in params.items()}
    for k, p in ps.items():
        p.grad = to_torch(grads[k])
    found_inf = torch.zeros((), dtype=torch.float32)
    inv_scale = torch_inv_scale(scale)
    for dtype in {p.dtype for p in ps.values()}:
        group = [p.grad for p in ps.values() if p.dtype == dtype]
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
    unscaled = {k: to_numpy(p.grad) for k, p in ps.items()}
    if not found_inf.item():
        with torch.no_grad():
            torch.optim.SGD(list(ps.values()), lr=1.0).step()
    return {k: to_numpy(p.detach()) for k, p in ps.items()}, unscaled, bool(found_inf.item())


@st.composite
def params_and_grads(draw):
    params = {k: draw(arrays(x.dtype, LEAF_SIZE, finite_only=True))
              for k, x in draw(gradient_trees()).items()}
    return params, draw(gradient_trees())


@settings(max_examples=25, deadline=None)
@given(pg=params_and_grads(), scale=scales)
@example(pg=(fixed_tree(float32=[1.0, -2.0]), OVERFLOWS_IN_UNSCALING), scale=0.5)
@example(pg=(fixed_tree(float16=[1.0, 0.5]), fixed_tree(float16=[2048.0, -512.0])),
         scale=1024.0)
def test_a_wrapper_step_matches_a_gradscaler_step_with_sgd(pg, scale):
    """``with_loss_scaling(optax.sgd(1.0), StaticLossScale(s))`` (plain and fused, eagerly
    and under ``jit``) gives PyTorch's params wherever neither skips; where the library
    skips, params are bit-identical (and PyTorch either skipped too or wrote an inf/NaN)."""
    params, grads = pg
    want, unscaled, found_inf = torch_sgd_step(params, grads, scale)
    jparams, jgrads = jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, grads)
    opt_state = with_scale(SGD, jparams, scale)
    torch_nonfinite = any(not np.isfinite(as_f64(u)).all() for u in unscaled.values())
    for name, step in SGD_STEPS:
        new_params, state = step(jgrads, opt_state, jparams)
        skipped = not bool(state.last_step_applied)
        assert skipped == (found_inf or torch_nonfinite), name
        event("skipped" if skipped else "applied")
        if skipped and not found_inf:
            event("torch applied a non-finite update that the library skipped")
        for k, p in params.items():
            got = np.asarray(new_params[k])
            if skipped:
                # The plain path's p + -0.0 flushes a float32 subnormal param on CPU.
                keep = np.ones(p.shape, bool) if "fused" in name else ~f32_subnormal(p)
                assert same_bits(got, p, keep), (name, k)
                continue
            with np.errstate(all="ignore"):
                exact_sum = as_f64(p) - as_f64(unscaled[k])
            where = (comparable(grads[k], unscaled[k], scale) & ~f32_subnormal(p)
                     & not_subnormal(want[k]) & ~flushed_on_cpu(exact_sum, want[k]))
            assert same_bits(got, want[k], where), (
                f"{name} {k}: scale {scale!r}, p {p!r}, g {grads[k]!r}: got {got!r}, "
                f"torch {want[k]!r}")


def test_a_real_gradscaler_run_matches_a_dynamic_loss_scale_run():
    """``torch.amp.GradScaler`` itself (float32 params, SGD lr 1.0, the loss scaled and
    differentiated by each framework) against the fused wrapper with a ``DynamicLossScale``
    of the same settings, step by step: params, scale and growth tracker."""
    init_scale, growth_interval = 2.0**10, 2
    param0 = np.asarray([1.0, -2.0, 0.5], np.float32)
    true_grads = [np.asarray(g, np.float32) for g in (
        [0.5, 0.25, -1.0], [1.0, 2.0, 3.0], [INF, 0.0, 0.0], [0.125, -0.5, 1.0],
        [1e-3, 2e-3, -3e-3], [NAN, 1.0, 1.0], [0.75, 0.5, -0.25], [4.0, -8.0, 16.0])]

    p = torch.tensor(param0, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=2.0,
                                  backoff_factor=0.5, growth_interval=growth_interval)
    tx = ls.with_loss_scaling(optax.sgd(1.0), ls.DynamicLossScale(
        init_scale=init_scale, growth_interval=growth_interval))
    params = jnp.asarray(param0)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, g):
        s = ls.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: ls.scale(s, jnp.sum(p * g)))(params)
        return ls.apply_gradients(tx, grads, opt_state, params)

    scales = []
    for g in true_grads:
        opt.zero_grad()
        scaler.scale((p * torch.from_numpy(g)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        params, opt_state = train_step(params, opt_state, jnp.asarray(g))
        np.testing.assert_array_equal(np.asarray(params), p.detach().numpy())
        ours = ls.get_loss_scale(opt_state)
        assert float(ours.loss_scale) == scaler.get_scale()
        assert int(ours.growth_tracker) == int(scaler._get_growth_tracker())
        scales.append(scaler.get_scale())
    assert int(ls.metrics(opt_state)["skipped_steps"]) == 2
    assert scales == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
    assert not np.array_equal(np.asarray(params), param0)
