"""``ls.find_overflow`` on a float16 GRU classifier under ``lax.scan`` whose backward pass
overflows at a known iteration, with and without ``jax.checkpoint`` on the scanned step:
the interpreter's loops, its joined origins and its places (debug/_interpret.py).

The model is built so that the arithmetic is known by hand. The inputs, the initial state
and the biases are 0, so the state stays exactly 0, both gates are 1/2 and the candidate 0.
The n gate's recurrent kernel is ``6 * I``, so each step of the backward pass doubles the
state's cotangent: ``dh_prev = z * dh + r * (1 - z) * dh @ (6 I)^T = dh / 2 + 3 dh / 2``
(two terms, then their sum: ``add_any``). Each step also adds ``(1 - z) * dh``, summed over
the batch of 3, to the gradient of the n gate's bias: ``3 dh / 2``. That gradient is a sum
over the iterations, carried by the backward scan in the dtype of what the scan closes
over:

* ``cast_in_step=False`` (the weights cast to float16 once, before the scan): the sum is
  float16, about 3 dh, and it passes 65504 one iteration before the state's cotangent
  (2 dh) does, at ``SUM_SCALE``;
* ``cast_in_step=True`` (cast inside the step): the sum is float32, and at
  ``STATE_SCALE`` the first overflow is the state's cotangent, ``dh / 2 + 3 dh / 2``,
  with both terms (and the step's bias term) finite.

The truth is a stepwise reference written here, independent of the library: the forward
states, then one jitted ``jax.vjp`` of the cell per step, from the last index down as the
backward scan runs them, the bias gradient summed in the dtype the scan carries it in. It
reports the first index at which anything of the carry (the state's cotangent, the sum) or
the step's bias term is not finite, and which.

Iterations are counted by index into the scanned axis (what ``loops`` reports); the
backward scan runs them from the last index down (``loop_runs`` says the how-manieth).
"""

from __future__ import annotations

import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scaling as ls

F16, F32 = jnp.float16, jnp.float32
T, IN, H, C, B = 12, 4, 4, 4, 3  # steps, input width, hidden width, classes, batch
GROWTH = 6.0  # the n gate's recurrent kernel is GROWTH * I: dh doubles per backward step
# dh = scale / B entering the last step's backward pass, doubled by each step after it
SUM_SCALE = 1152.0  # dh = 384 * 2**k: the float16 sum 576 * (2**(k + 1) - 1) is inf at k = 6
STATE_SCALE = 864.0  # dh = 288 * 2**k: at k = 7 the state's 2 dh is inf, 3 dh / 2 is not
LINES = {match[1]: i + 1 for i, text in enumerate(Path(__file__).read_text().splitlines())
         if (match := re.search(r"# <- ([a-z ]+)$", text))}


def gru_cell(w, h, x):
    """One float16 GRU step, as in flax's GRUCell (one bias per gate)."""
    wi, wh, b = w
    with jax.named_scope("cell"):
        gi, gh = x @ wi, h @ wh  # <- recurrent
        r = jax.nn.sigmoid(gi[:, :H] + gh[:, :H] + b[:H])  # <- r gate
        z = jax.nn.sigmoid(gi[:, H:2 * H] + gh[:, H:2 * H] + b[H:2 * H])  # <- z gate
        n = jnp.tanh(gi[:, 2 * H:] + r * gh[:, 2 * H:] + b[2 * H:])  # <- n gate
        return (1 - z) * n + z * h  # <- new state


def recurrent_init(key, shape, dtype=F32):
    del key
    return jnp.zeros(shape, dtype).at[:, 2 * H:].set(GROWTH * jnp.eye(H))


def head_init(key, shape, dtype=F32):
    del key
    # logits 0, label 0: the cotangent of the logits is (p - onehot) / B, whose first two
    # entries are -(1 - 1/C) / B and 1/C / B; so dh = scale / B per unit
    return jnp.zeros(shape, dtype).at[:, :2].set(jnp.array([-1.0, 1.0], dtype))


class GRUClassifier(nn.Module):
    remat: bool = False
    cast_in_step: bool = False

    @nn.compact
    def __call__(self, xs):
        weights = (self.param("wi", nn.initializers.zeros, (IN, 3 * H)),
                   self.param("wh", recurrent_init, (H, 3 * H)),
                   self.param("b", nn.initializers.zeros, (3 * H,)))
        cast = lambda: tuple(w.astype(F16) for w in weights)  # noqa: E731
        once = cast()

        def step(h, x):
            return gru_cell(cast() if self.cast_in_step else once, h, x), None

        if self.remat:
            step = jax.checkpoint(step)
        h, _ = jax.lax.scan(step, jnp.zeros((xs.shape[0], H), F16),
                            jnp.swapaxes(xs, 0, 1))
        return nn.Dense(C, dtype=F16, kernel_init=head_init)(h)


XS = jnp.zeros((B, T, IN), F16)
LABELS = jnp.zeros(B, jnp.int32)


def case(remat=False, cast_in_step=False):
    model = GRUClassifier(remat, cast_in_step)
    params = model.init(jax.random.key(0), XS)["params"]

    def loss_fn(params, xs, labels):
        logits = model.apply({"params": params}, xs).astype(F32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss_fn, params


def stepwise_reference(params, cast_in_step, scale):
    """``(index, what)``: the first index, in the backward scan's order (the last first), at
    which an inf/NaN appears, and where: a subset of ``{"sum", "state", "term"}`` (the bias
    gradient summed so far, the state's cotangent, this step's bias term)."""
    weights = tuple(params[k] for k in ("wi", "wh", "b"))
    step = jax.jit(lambda w, h, x: gru_cell(tuple(v.astype(F16) for v in w), h, x))
    hs = [jnp.zeros((B, H), F16)]
    for t in range(T):
        hs.append(step(weights, hs[-1], XS[:, t]))

    def head_loss(h):
        logits = nn.Dense(C, dtype=F16).apply({"params": params["Dense_0"]}, h).astype(F32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean() * scale

    dh = jax.grad(head_loss)(hs[-1])
    # The bias as the scan sees it: float32 when cast inside the step, else the float16
    # copy made before the scan; its cotangent, and their sum, are in that dtype.
    bias = weights[2].astype(F32 if cast_in_step else F16)
    cell_vjp = jax.jit(lambda b, h, x, ct: jax.vjp(
        lambda b, h: gru_cell((weights[0].astype(F16), weights[1].astype(F16),
                               b.astype(F16)), h, x), b, h)[1](ct))
    total = jnp.zeros_like(bias)
    for t in range(T - 1, -1, -1):
        term, dh = cell_vjp(bias, hs[t], XS[:, t], dh)
        total = total + term
        what = {name for name, value in (("sum", total), ("state", dh), ("term", term))
                if not bool(jnp.all(jnp.isfinite(value)))}
        if what:
            return t, what
    return None, set()


@pytest.mark.parametrize("cast_in_step", [False, True])
def test_the_model_overflows_where_the_stepwise_reference_says(cast_in_step):
    loss_fn, params = case(cast_in_step=cast_in_step)
    scale = STATE_SCALE if cast_in_step else SUM_SCALE
    # float16 sum: it alone overflows, one step before the state's cotangent; float32:
    # the state's cotangent alone
    assert stepwise_reference(params, cast_in_step, scale) == (
        (4, {"state"}) if cast_in_step else (5, {"sum"}))
    assert stepwise_reference(params, cast_in_step, 1.0) == (None, set())
    if not cast_in_step:  # at the other scale the float16 sum and the state go together
        assert stepwise_reference(params, False, STATE_SCALE)[0] == 4
    finite = jax.jit(lambda p: jax.tree.map(lambda g: jnp.all(jnp.isfinite(g)), jax.grad(
        lambda q: loss_fn(q, XS, LABELS) * scale)(p)))(params)
    assert not all(jax.tree.leaves(finite))  # the compiled step overflows too


@pytest.mark.parametrize("remat", [True, False], ids=["checkpointed_scan", "scan"])
def test_a_float16_gradient_sum_that_overflows_is_named_at_its_iteration(remat):
    loss_fn, params = case(remat=remat)
    index, _ = stepwise_reference(params, False, SUM_SCALE)
    report = ls.find_overflow(loss_fn, params, XS, LABELS, scale=SUM_SCALE)
    assert (report.phase, report.primitive, report.dtype) == ("backward", "add_any",
                                                              "float16"), report
    assert report.loops == (("scan", index),), report  # by index into the scanned axis
    # The sum is placed where the bias is used. Without jax.checkpoint JAX adds each use's
    # term on its own, and the n gate's overflows; under it the checkpointed step gives one
    # term for all three uses, placed at one of them.
    assert report.layer == "GRUClassifier/cell" and report.file == __file__, report
    assert report.line == LINES["n gate"] or remat and report.line in (
        LINES["r gate"], LINES["z gate"]), report
    # The state's cotangent overflows at the next index the scan runs, and reaches the
    # gradients too (partly through entries the sum already made inf): a later overflow,
    # never a masked one.
    assert not report.notes, report.notes
    assert any(f"scan iteration {index - 1} " in later for later in report.later), report
    assert report.loop_runs == ((T - index, T),), report  # the 7th of 12 to run
    text = str(report)
    assert "None:None" not in text and "rematted_computation" not in text, text
    assert "summed over the iterations" in text and f"of 0..{T - 1}" in text, text
    assert report.compiled_finite is False


@pytest.mark.parametrize("remat", [True, False], ids=["checkpointed_scan", "scan"])
def test_with_a_float32_gradient_sum_the_states_cotangent_is_the_first_overflow(remat):
    loss_fn, params = case(remat=remat, cast_in_step=True)
    index, _ = stepwise_reference(params, True, STATE_SCALE)
    report = ls.find_overflow(loss_fn, params, XS, LABELS, scale=STATE_SCALE)
    # dh_prev = dh / 2 + 3 dh / 2: both terms below 65504, their sum above
    assert (report.phase, report.primitive, report.loops) == (
        "backward", "add_any", (("scan", index),)), report
    # the state's two uses meet where the second is: its product with the kernel
    assert report.layer == "GRUClassifier/cell", report
    assert (report.file, report.line) == (__file__, LINES["recurrent"]), report
    assert "None:None" not in str(report) and "summed over" not in str(report)


def test_the_reference_and_the_report_agree_at_larger_scales():
    """Each doubling of the scale moves the overflow one index earlier in the scan's order
    (one index higher); the report follows the reference."""
    loss_fn, params = case()
    for scale in (2 * SUM_SCALE, 8 * SUM_SCALE):
        index, what = stepwise_reference(params, False, scale)
        assert what == {"sum"}
        report = ls.find_overflow(loss_fn, params, XS, LABELS, scale=scale)
        assert report.loops == (("scan", index),), (scale, report)
    assert not ls.find_overflow(loss_fn, params, XS, LABELS, scale=1.0)


def test_the_hand_computation_gives_the_same_indices():
    """The arithmetic of the module docstring, in float64 (every value is exact in
    float16): step k of the backward pass (k = 0 at the last index) adds 3 dh_k / 2 to the
    sum and leaves 2 dh_k, with dh_k = 2**k scale / 3; float16 rounds 65520 and up to inf."""
    def first(scale):
        dh = [scale / B * 2.0**k for k in range(T)]
        sums = np.cumsum([B / 2 * d for d in dh])
        return (T - 1 - next(k for k, s in enumerate(sums) if s >= 65520),
                T - 1 - next(k for k, d in enumerate(dh) if 2 * d >= 65520))

    assert first(SUM_SCALE) == (5, 4)  # the sum first, then the state
    assert first(STATE_SCALE)[1] == 4 and B / 2 * STATE_SCALE / B * 2.0**7 < 65520
