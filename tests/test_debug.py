"""ls.find_overflow and ls.float16_report on models built to overflow in a known place.

Every framework gets the same two-layer network, ``first`` (identity) then ``second``:

* forward overflow: ``second``'s kernel is all 3e4, the input ones, so its float16
  activations are 4 * 3e4 = 1.2e5 > 65504 (``dot_general`` in ``second``);
* backward-only overflow: the input is 1e-3 and ``second``'s kernel all 8, so the forward
  values stay below 0.04, but at scale 2**15 the cotangent of ``second``'s input is
  4 * 8 * 2**15 = 2**20 > 65504 (at scale 1 it is 32: healthy).

The line asserted is the user's line that calls ``second`` (marked ``# <- second``).
"""

import functools
import gc
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import loss_scaling as ls
from loss_scaling.debug import _interpret

F16, F32 = jnp.float16, jnp.float32
BIG, AMP, SMALL = 3e4, 8.0, 1e-3
SECOND_LINES = [i + 1 for i, text in enumerate(Path(__file__).read_text().splitlines())
                if text.rstrip().endswith("# <- second")]


def kernels(second):
    return np.eye(4, dtype=np.float32), np.full((4, 4), second, np.float32)


# ------------------------------------------------------------------------- the models


class NnxNet(nnx.Module):
    def __init__(self, second):
        self.first = nnx.Linear(4, 4, use_bias=False, dtype=F16, rngs=nnx.Rngs(0))
        self.second = nnx.Linear(4, 4, use_bias=False, dtype=F16, rngs=nnx.Rngs(1))
        self.first.kernel[...], self.second.kernel[...] = map(jnp.asarray, kernels(second))

    def __call__(self, x):
        return self.second(self.first(x))  # <- second


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, use_bias=False, dtype=F16, name="first")(x)
        return nn.Dense(4, use_bias=False, dtype=F16, name="second")(x)  # <- second


class EqxNet(eqx.Module):
    first: eqx.nn.Linear
    second: eqx.nn.Linear

    def __init__(self, second):
        a, b = kernels(second)
        self.first = eqx.nn.Linear(4, 4, use_bias=False, key=jax.random.key(0))
        self.second = eqx.nn.Linear(4, 4, use_bias=False, key=jax.random.key(1))
        self.first = eqx.tree_at(lambda m: m.weight, self.first, jnp.asarray(a.T, F16))
        self.second = eqx.tree_at(lambda m: m.weight, self.second, jnp.asarray(b.T, F16))

    def __call__(self, x):
        x = jax.vmap(self.first)(x.astype(F16))
        return jax.vmap(self.second)(x)  # <- second


def plain_net(params, x):
    with jax.named_scope("first"):
        x = x @ params["first"].astype(F16)
    with jax.named_scope("second"):
        return x @ params["second"].astype(F16)  # <- second


def loss_of(apply):
    return lambda model, x: jnp.sum(apply(model, x).astype(F32))


def make(framework, second):
    """``(loss_fn, model_or_params, expected layer)`` for one framework."""
    if framework == "nnx":
        return loss_of(lambda m, x: m(x)), NnxNet(second), "second"
    if framework == "linen":
        a, b = kernels(second)
        params = {"params": {"first": {"kernel": a}, "second": {"kernel": b}}}
        return loss_of(LinenNet().apply), jax.tree.map(jnp.asarray, params), "LinenNet/second"
    if framework == "equinox":
        return loss_of(lambda m, x: m(x)), EqxNet(second), "second/eqx.nn.Linear"
    a, b = kernels(second)
    return loss_of(plain_net), {"first": jnp.asarray(a), "second": jnp.asarray(b)}, "second"


FRAMEWORKS = pytest.mark.parametrize("framework", ["nnx", "linen", "equinox", "plain"])


def assert_in_second(report, phase, layer):
    assert report.found and bool(report)
    assert (report.phase, report.primitive, report.dtype) == (phase, "dot_general", "float16")
    assert report.layer == layer, report
    assert report.file == __file__ and report.line in SECOND_LINES, report
    assert report.inputs_finite
    text = str(report)
    assert f"{phase} pass" in text and "dot_general" in text and f":{report.line} " in text


@FRAMEWORKS
def test_a_forward_overflow_is_found_in_the_named_layer(framework):
    loss_fn, model, layer = make(framework, BIG)
    report = ls.find_overflow(loss_fn, model, jnp.ones((1, 4), F16))
    assert_in_second(report, "forward", layer)
    assert report.max_finite_input == BIG  # the kernel; its input is 1
    assert report.shape == (1, 4) or framework == "equinox"  # vmapped: one example


@FRAMEWORKS
def test_a_backward_only_overflow_is_found_in_the_named_layer_at_scale_2_15(framework):
    loss_fn, model, layer = make(framework, AMP)
    x = jnp.full((1, 4), SMALL, F16)
    assert not ls.find_overflow(loss_fn, model, x)  # scale 1: healthy
    report = ls.find_overflow(loss_fn, model, x, scale=2.0**15)
    assert_in_second(report, "backward", layer)
    assert report.scale == 2.0**15 and "loss scale 32768" in str(report)
    assert report.max_finite_input == 2.0**15  # the cotangent of second's output


@FRAMEWORKS
def test_a_healthy_model_reports_nothing(framework):
    loss_fn, model, _ = make(framework, 0.5)
    report = ls.find_overflow(loss_fn, model, jnp.ones((2, 4), F16), scale=2.0**10)
    assert not report.found and not report and report.phase is None
    assert str(report).startswith("find_overflow: the loss and every gradient")


def test_the_default_scale_is_the_one_the_first_argument_holds():
    loss_fn, model, _ = make("nnx", AMP)
    x = jnp.full((1, 4), SMALL, F16)
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.StaticLossScale(2.0**15))
    optimizer = ls.nnx.Optimizer(model, tx, wrt=nnx.Param)
    report = ls.find_overflow(loss_fn, optimizer, model, x)
    assert (report.phase, report.scale, report.layer) == ("backward", 2.0**15, "second")
    loss_fn, params, _ = make("plain", AMP)
    state = ls.TrainState.create(apply_fn=None, params=params, tx=tx)
    assert ls.find_overflow(loss_fn, state, state.params, x).phase == "backward"
    assert ls.find_overflow(loss_fn, state.opt_state, params, x).scale == 2.0**15
    assert not ls.find_overflow(loss_fn, state, params, x, scale=1.0)


def test_nnx_differentiates_the_optimizers_wrt_filter_only():
    loss_fn, model, _ = make("nnx", AMP)
    model.first.kernel = nnx.Variable(model.first.kernel[...])  # not a Param: not in wrt
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.StaticLossScale(2.0**15))
    optimizer = ls.nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jnp.full((1, 4), SMALL, F16)
    # Only second's kernel is differentiated: its cotangent, x^T * 2**15 = 32.8, is
    # finite; the input cotangent that overflows is never computed.
    assert not ls.find_overflow(loss_fn, optimizer, model, x)


class NnxTrainingNet(nnx.Module):
    """A model whose forward pass writes state: BatchNorm statistics, Dropout's RNG count."""

    def __init__(self):
        self.net = NnxNet(BIG)
        self.norm = nnx.BatchNorm(4, dtype=F16, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

    def __call__(self, x):
        return self.drop(self.norm(self.net(x)))


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_nnx_models_in_training_mode_are_reported_and_left_untouched(with_optimizer):
    model = NnxTrainingNet()
    holder = ((ls.nnx.Optimizer(model, ls.with_loss_scaling(optax.sgd(0.1)), wrt=nnx.Param),)
              if with_optimizer else ())
    def snapshot():
        return [np.array(jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key)
                         else v) for v in jax.tree.leaves(nnx.state(model))]

    before = snapshot()
    loss_fn = loss_of(lambda m, x: m(x))
    x = jnp.full((2, 4), 4.0, F16)
    report = ls.find_overflow(loss_fn, *holder, model, x)
    assert report.found and report.layer == "net/second", report
    table = ls.float16_report(loss_fn, *holder, model, x)
    assert "net/second" in str(table)
    for after, was in zip(snapshot(), before, strict=True):  # statistics, RNG counts
        np.testing.assert_array_equal(after, was)


def test_bad_arguments_get_errors_that_say_what_to_pass():
    with pytest.raises(TypeError, match="loss_fn's arguments"):
        ls.find_overflow(lambda w: w)
    with pytest.raises(ValueError, match=r"scale=-1\.0: pass a positive"):
        ls.find_overflow(lambda w: jnp.sum(w), jnp.ones(2), scale=-1.0)
    with pytest.raises(TypeError, match=r"traced value \(argument 1\).*outside jit"):
        jax.jit(lambda w: ls.float16_report(jnp.sum, w).scale)(jnp.ones(2))


# ------------------------------------------------------------- loops, remat, custom rules


def stacked_kernels(bad_layer, value):
    w = np.stack([np.eye(4, dtype=np.float32)] * 4)
    w[bad_layer] = value
    return jnp.asarray(w)


def scanned_loss(w, x):
    def layer(h, w_i):
        with jax.named_scope("layer"):
            return h @ w_i.astype(F16), None  # <- scanned

    return jnp.sum(jax.lax.scan(layer, x, w)[0].astype(F32))


SCANNED_LINE = next(i + 1 for i, t in enumerate(Path(__file__).read_text().splitlines())
                    if t.rstrip().endswith("# <- scanned"))


def test_inside_lax_scan_the_iteration_of_the_overflowing_layer_is_reported():
    forward = ls.find_overflow(scanned_loss, stacked_kernels(2, BIG), jnp.ones((1, 4), F16))
    assert (forward.phase, forward.primitive, forward.loops) == ("forward", "dot_general",
                                                                 (("scan", 2),))
    assert forward.layer == "layer" and forward.line == SCANNED_LINE
    backward = ls.find_overflow(scanned_loss, stacked_kernels(1, AMP),
                                jnp.full((1, 4), SMALL, F16), scale=2.0**15)
    assert (backward.phase, backward.loops) == ("backward", (("scan", 1),))
    assert backward.primitive == "dot_general" and backward.line == SCANNED_LINE


class ScanBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, use_bias=False, dtype=F16, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)  # <- nnx scanned


class ScanNet(nnx.Module):
    def __init__(self, bad_layer, value):
        make_block = nnx.vmap(ScanBlock, in_axes=0, out_axes=0)
        self.blocks = make_block(nnx.Rngs(0).split(4))
        self.blocks.lin.kernel[...] = stacked_kernels(bad_layer, value)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(h, block):
            return block(h)

        return forward(x, self.blocks)


def test_inside_nnx_scan_the_layer_index_and_line_are_reported():
    loss_fn = loss_of(lambda m, x: m(x))
    line = next(i + 1 for i, t in enumerate(Path(__file__).read_text().splitlines())
                if t.rstrip().endswith("# <- nnx scanned"))
    report = ls.find_overflow(loss_fn, ScanNet(3, BIG), jnp.ones((1, 4), F16))
    assert (report.phase, report.primitive, report.loops) == ("forward", "dot_general",
                                                             (("scan", 3),))
    # nnx.scan merges a fresh block in its body: it is scoped by its class name.
    assert report.layer.endswith("ScanBlock/lin") and report.line == line, report
    backward = ls.find_overflow(loss_fn, ScanNet(1, AMP), jnp.full((1, 4), SMALL, F16),
                                scale=2.0**15)
    assert (backward.phase, backward.loops, backward.line) == ("backward", (("scan", 1),),
                                                               line)
    # In the first layer the cotangent that overflows is the batch's, which no gradient
    # needs (the scan computes it anyway): the step is finite, and it is only a note.
    first = ls.find_overflow(loss_fn, ScanNet(0, AMP), jnp.full((1, 4), SMALL, F16),
                             scale=2.0**15)
    assert not first and first.notes and "backward" in first.notes[0], first


def test_inside_jax_checkpoint_jit_cond_while_and_custom_rules():
    @jax.custom_vjp
    def passthrough(h):
        return h

    passthrough.defvjp(lambda h: (h, None), lambda _, g: (g,))

    @jax.custom_jvp
    def double(h):
        return 2 * h

    double.defjvp(lambda p, t: (2 * p[0], 2 * t[0]))

    @jax.jit
    def block(w, h):
        with jax.named_scope("ckpt"):
            return h @ w.astype(F16)  # <- remat

    def loss_fn(params, x):
        x = x @ params["v"].astype(F16)  # differentiated: its cotangent goes through all
        x = jax.lax.cond(jnp.sum(x) > 0, lambda a: a, lambda a: -a, x)
        n = jax.lax.while_loop(lambda c: c < 3, lambda c: c + 1, 0)
        h = jax.checkpoint(block)(params["w"], passthrough(double(x)) * n.astype(F16))
        return jnp.sum(h.astype(F32))

    line = next(i + 1 for i, t in enumerate(Path(__file__).read_text().splitlines())
                if t.rstrip().endswith("# <- remat"))
    w = jnp.full((4, 4), AMP / 6, F32)  # the input is 6x the batch: 8 as above
    x = jnp.full((1, 4), SMALL, F16)
    v = jnp.eye(4, dtype=F32)
    assert not ls.find_overflow(loss_fn, {"v": v, "w": w}, x)
    report = ls.find_overflow(loss_fn, {"v": v, "w": w}, x, scale=2.0**15)
    assert (report.phase, report.primitive, report.layer, report.line) == (
        "backward", "dot_general", "ckpt", line), report
    forward = ls.find_overflow(loss_fn, {"v": v, "w": jnp.full((4, 4), BIG, F32)},
                               jnp.ones((1, 4), F16))
    assert (forward.phase, forward.layer, forward.line) == ("forward", "ckpt", line)


def test_the_jax_internals_the_interpreter_relies_on():
    """Pins primitive names and parameter keys: a JAX release that renames one fails here."""
    def f(w):
        h = jax.checkpoint(jnp.sin)(w)
        h = jax.jit(jnp.cos)(h)
        h = jax.lax.scan(lambda c, _: (c * 2, None), h, None, length=2)[0]
        h = jax.lax.cond(h[0] > 0, jnp.exp, jnp.tanh, h)
        return jnp.sum(h)

    forward = jax.make_jaxpr(lambda w: jax.vjp(f, w))(jnp.ones(2))
    _, vjp = jax.vjp(f, jnp.ones(2))
    backward = jax.make_jaxpr(lambda v: v(jnp.ones(())))(vjp)
    names = {e.primitive.name: e.params for j in (forward, backward) for e in j.jaxpr.eqns}
    assert {"jit", "scan", "cond", "remat2"} <= names.keys() <= (
        _interpret.CALLS | {"scan", "cond", "while"} | set(names) - {"checkpoint"})
    assert {"jaxpr", "num_consts", "num_carry", "length", "reverse"} <= names["scan"].keys()
    assert "branches" in names["cond"] and "jaxpr" in names["remat2"]
    loop = jax.make_jaxpr(lambda n: jax.lax.while_loop(lambda c: c < n, lambda c: c + 1, 0))(3)
    (eqn,) = loop.jaxpr.eqns
    assert {"cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"} <= eqn.params.keys()
    assert [type(e).__name__ for e in eqn.source_info.name_stack.stack] == []


# ------------------------------------------------- which non-finite values count


def masked_log_then_real_exp(w, x):
    a = jnp.log(x)  # x[0] = 0: -inf at entry 0, masked below (harmless)
    b = jnp.exp(w * x)  # entry 1 overflows float16: the real one
    d = jnp.where(jnp.array([False, True]), a + b, 0)  # entry 0 dropped, entry 1 kept
    return jnp.sum(d.astype(F32))


@pytest.mark.parametrize("wrap", ["plain", "jit", "scan", "cond", "checkpoint"])
def test_entries_are_followed_one_by_one_and_the_real_overflow_is_named(wrap):
    """The -inf of ``log`` and the inf of ``exp`` meet in one array, in different entries:
    only the entry that reaches the loss counts, inside any higher-order primitive."""
    f = masked_log_then_real_exp
    loss_fn = {
        "plain": f, "jit": jax.jit(f), "checkpoint": jax.checkpoint(f),
        "scan": lambda w, x: jax.lax.scan(lambda c, _: (c + f(w, x), None),
                                          jnp.zeros((), F32), None, length=2)[0],
        "cond": lambda w, x: jax.lax.cond(w > 0, f, lambda *_: jnp.zeros((), F32), w, x)}[wrap]
    x = jnp.array([0.0, 12.0], F16)
    report = ls.find_overflow(loss_fn, jnp.asarray(1.0, F16), x)
    # (under checkpoint the backward pass recomputes exp: the gradient's inf is that one's)
    assert (report.phase, report.primitive) == ("forward", "exp"), report
    assert report.reaches.startswith("loss"), report
    assert any(n.startswith("forward log") for n in report.notes), report
    assert not ls.find_overflow(loss_fn, jnp.asarray(1.0, F16), jnp.array([0.0, 1.0], F16))


def test_a_non_finite_argument_is_reported_only_if_it_matters():
    # where(isfinite(x), x * w, 0) would not do: its gradient is 0 * NaN = NaN
    loss_fn = lambda w, x: jnp.sum(jnp.where(jnp.isfinite(x), x, 0.0) * w)  # noqa: E731
    x = jnp.array([jnp.nan, 1.0])
    assert not ls.find_overflow(loss_fn, jnp.ones(2), x)  # the NaN is selected away
    report = ls.find_overflow(lambda w, x: jnp.sum(x * w), jnp.ones(2), x)
    assert report.found and report.primitive is None and not report.inputs_finite
    assert "already holds an inf or NaN" in str(report), report


def test_never_a_later_equation_than_the_first_that_matters():
    """The first overflow that reaches the loss is ``x * 3e4`` (entry 1); a later, larger
    overflow of the same entry (``exp``) only carries it on."""
    def loss_fn(w, x):
        h = x * w  # entry 1: 4 * 3e4 overflows float16 here
        return jnp.sum(jnp.exp(h).astype(F32))

    report = ls.find_overflow(loss_fn, jnp.asarray(3e4, F16), jnp.array([0.0, 4.0], F16))
    assert report.primitive == "mul" and report.phase == "forward", report


def test_a_later_overflow_into_entries_already_inf_is_listed_not_called_masked():
    """Two overflows whose inf meet in the same entries: the earlier is the finding, the
    later one reaches the loss too (its inf went on in the same entries), so it is a
    later overflow, never 'masked or selected away'."""
    def loss_fn(w, x):
        with jax.named_scope("early"):
            a = x * w[0]  # 4 * 3e4: inf
        with jax.named_scope("late"):
            b = x * w[1]  # inf as well, in the same entry
        return jnp.sum((a + b).astype(F32))

    report = ls.find_overflow(loss_fn, jnp.full(2, 3e4, F16), jnp.array([4.0], F16))
    assert (report.phase, report.primitive, report.layer) == ("forward", "mul", "early")
    assert not report.notes, report.notes
    assert len(report.later) == 1 and " mul " in report.later[0], report.later
    assert " in late at " in report.later[0] and "later" in str(report)
    # a masked one stays a note: the later value is selected away
    masked = ls.find_overflow(
        lambda w, x: jnp.sum(jnp.where(jnp.array([True, False]), x * w[0],
                                       x * w[1]).astype(F32)),
        jnp.array([3e4, 3e4], F16), jnp.array([4.0, 1.0], F16))
    assert masked.found and not masked.later and masked.notes, masked


def test_the_parameters_the_origin_rules_rely_on():
    """Pins what ``_interpret._propagate`` reads, and that each named primitive exists."""
    def f(x, i):
        y = jnp.einsum("ij,jk->ik", x, x)
        return jax.lax.cumsum(jnp.sum(y, axis=0))[i] + x[jnp.array([0, 1]), 0].sum()

    jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 2)), 1)
    params = {e.primitive.name: e.params for e in jaxpr.jaxpr.eqns}
    assert "dimension_numbers" in params["dot_general"]
    assert "axes" in params["reduce_sum"]
    assert {"axis", "reverse"} <= params["cumsum"].keys()
    assert "fill_value" in params["gather"]
    assert {"dot_general", "reduce_sum", "cumsum", "gather"} <= set(params)


# ------------------------------------------------------------------ 8 virtual devices

SHARDED = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import loss_scaling as ls
    assert jax.device_count() == 8
    mesh = jax.make_mesh((8,), ("data",))
    x = jax.device_put(jnp.ones((8, 4), jnp.float16), NamedSharding(mesh, P("data")))

    @jax.jit
    def loss_fn(w, x):
        with jax.named_scope("sharded_layer"):
            h = x @ w.astype(jnp.float16)
        return jnp.mean(h.astype(jnp.float32))

    for value in (3e4, 1.0):  # an overflow, then a healthy model (one process for both)
        w = jax.device_put(jnp.full((4, 4), value, jnp.float32), NamedSharding(mesh, P()))
        report = ls.find_overflow(loss_fn, w, x)
        print(repr((report.found, report.phase, report.primitive, report.layer)))
''')


def test_a_function_sharded_over_8_virtual_devices():
    env = {**__import__("os").environ,
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-2:] == [
        repr((True, "forward", "dot_general", "sharded_layer")), repr((False, None, None, ""))]


# ------------------------------------------------------------------ float16_report


def two_layer_loss(params, x):
    with jax.named_scope("l1"):
        h = x @ params["w1"]
    with jax.named_scope("l2"):
        y = h @ params["w2"]
    return jnp.sum(y)


TWO_LAYER = {"w1": np.arange(12, dtype=np.float32).reshape(3, 4) - 5.0,
             "w2": 1e-6 * np.array([[1.0], [-2.0], [3.0], [4.0]], np.float32)}
TWO_LAYER_X = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]], np.float32)


@pytest.mark.parametrize("scale", [1.0, 2.0**15])
def test_the_readiness_report_matches_a_hand_computation_on_two_layers(scale):
    w1, w2, x = TWO_LAYER["w1"], TWO_LAYER["w2"], TWO_LAYER_X
    h = x @ w1
    y = h @ w2
    ct = np.full((2, 1), scale, np.float32)
    hand = {  # layer: (forward max, backward max, backward entries below 2**-14)
        "l1": (np.abs(h).max(), np.abs(x.T @ (ct @ w2.T)).max(), x.T @ (ct @ w2.T)),
        "l2": (np.abs(y).max(), max(np.abs(h.T @ ct).max(), np.abs(ct @ w2.T).max()), None)}
    table = ls.float16_report(two_layer_loss, jax.tree.map(jnp.asarray, TWO_LAYER),
                              jnp.asarray(x), scale=scale)
    rows = {row.layer: row for row in table.rows}
    assert {"l1", "l2"} <= rows.keys() and len(rows) == 3  # and the sum, by its line
    for layer, (fwd, bwd, _) in hand.items():
        np.testing.assert_allclose(rows[layer].forward_max, fwd, rtol=1e-5)
        np.testing.assert_allclose(rows[layer].backward_max, bwd, rtol=1e-5)
        np.testing.assert_allclose(rows[layer].headroom,
                                   min(np.log2(65504 / fwd), np.log2(65504 / bwd)), rtol=1e-5)
    # l1's weight gradient is ~1e-5 at scale 1, all below float16's smallest normal; at
    # 2**15 it is lifted into range.
    dw1 = np.abs(hand["l1"][2])  # a third of it is exactly 0: x's first column sums to 0
    assert np.all(dw1 < 2.0**-14) == (scale == 1.0)
    assert rows["l1"].underflow == np.mean((dw1 > 0) & (dw1 < 2.0**-14))
    assert rows["l1"].underflow == (8 / 12 if scale == 1.0 else 0.0)
    assert rows["l1"].zero == 4 / 12
    # l2's input cotangent, 1e-6 * scale, is below it at scale 1 (its weight's is not)
    assert (0 < rows["l2"].underflow < 1) == (scale == 1.0) and rows["l2"].zero == 0.0
    assert [r.headroom for r in table.rows] == sorted(r.headroom for r in table.rows)
    (loss_row,) = [r for layer, r in rows.items() if layer not in hand]
    assert loss_row.layer.startswith("test_debug.py:") and loss_row.backward_max == scale
    bwd_rooms = [np.log2(65504 / r.backward_max) for r in table.rows]
    assert table.table_scale == scale * 2.0 ** np.floor(min(bwd_rooms))
    # float32 throughout: the rows are held to float16's range, and there is no verdict
    assert table.hypothetical and table.fits is None and table.max_scale is None
    text = str(table)
    assert "l1" in text and "underflow" in text and "Pass the float16 version" in text


def test_the_readiness_report_on_the_demo_model_sorts_its_layers_by_headroom():
    from loss_scaling import demo

    model = demo.MLP(dtype=F16)
    x, y = map(jnp.asarray, demo.make_spirals(32, seed=0))
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]  # one compile, not 18
    table = ls.float16_report(lambda p, x, y: demo._cross_entropy(model, p, x, y),
                              params, x, y, scale=2.0**15)
    layers = {r.layer for r in table.rows}
    assert {f"MLP/Dense_{i}" for i in range(demo.DEPTH + 1)} <= layers
    assert [r.headroom for r in table.rows] == sorted(r.headroom for r in table.rows)
    assert table.fits and table.max_scale >= 2.0**15
    # The vanishing gradient: the lowest layer's cotangents are the smallest.
    rows = {r.layer: r for r in table.rows}
    assert rows["MLP/Dense_0"].backward_max < rows[f"MLP/Dense_{demo.DEPTH}"].backward_max


class Attention(nnx.Module):
    """One head (nnx.MultiHeadAttention's float16 dot_general asks for float32 results,
    which XLA's CPU backend refuses)."""

    def __init__(self, dim, rngs):
        make = lambda: nnx.Linear(dim, dim, use_bias=False, dtype=F16, rngs=rngs)  # noqa: E731
        self.query, self.key, self.value, self.out = make(), make(), make(), make()

    def __call__(self, h):
        q, k, v = self.query(h), self.key(h), self.value(h)
        scores = jnp.einsum("btd,bsd->bts", q, k) / jnp.sqrt(jnp.float16(q.shape[-1]))
        return self.out(jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores), v))


class TinyTransformer(nnx.Module):
    # Vocabulary, width and sequence length are equal (6) in the test below: the eager
    # interpreter compiles each primitive once per shape, and equal shapes share those
    # compiles (half the run time); the layers and the report's assertions are the same.
    def __init__(self, rngs, vocab=6, dim=6):
        self.embed = nnx.Embed(vocab, dim, dtype=F16, rngs=rngs)
        self.attn = Attention(dim, rngs)
        self.norm = nnx.LayerNorm(dim, dtype=F16, rngs=rngs)
        self.mlp = nnx.Linear(dim, dim, dtype=F16, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, dtype=F16, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        h = h + self.attn(h)
        h = h + jax.nn.gelu(self.mlp(self.norm(h)))
        return self.head(h)


def test_the_readiness_report_on_a_small_transformer():
    model = nnx.jit(lambda: TinyTransformer(nnx.Rngs(0)))()  # one compile, not one per init
    tokens = jnp.arange(12).reshape(2, 6) % 6

    def loss_fn(model, tokens):
        logits = model(tokens).astype(F32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    table = ls.float16_report(loss_fn, model, tokens, scale=2.0**15)
    layers = {r.layer for r in table.rows}
    assert {"embed", "attn/query", "attn/key", "attn/value", "attn/out", "norm", "mlp",
            "head"} <= layers, layers
    assert [r.headroom for r in table.rows] == sorted(r.headroom for r in table.rows)
    assert table.fits
    found = ls.find_overflow(loss_fn, model, tokens, scale=2.0**30)
    assert found.phase == "backward"


class LinenThree(nn.Module):
    """Three float16 layers: ``second``'s kernel is all 3e4, so its activations overflow
    from finite inputs; ``third`` and the loss only carry that inf forward, ``first``'s
    cotangents carry it back."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, use_bias=False, dtype=F16, name="first")(x)
        x = nn.Dense(4, use_bias=False, dtype=F16, name="second",
                     kernel_init=nn.initializers.constant(BIG))(x)
        return nn.Dense(4, use_bias=False, dtype=F16, name="third")(x)


def test_the_first_forward_overflow_tops_the_table_and_the_rows_that_carry_it_say_so():
    model = LinenThree()
    x = jnp.ones((1, 4), F16)
    params = model.init(jax.random.key(0), x)
    loss_fn = loss_of(model.apply)
    table = ls.float16_report(loss_fn, params, x)
    top = table.rows[0]
    # in program order "first" (whose backward values carry the inf) would come first
    assert (top.layer, top.headroom) == ("LinenThree/second", -np.inf), table
    assert top.overflow == "first", top
    assert top.op.startswith("dot_general"), top
    carried = {r.layer for r in table.rows if r.overflow == "carried"}
    assert {"LinenThree/first", "LinenThree/third"} <= carried, table
    assert "forward dot_general in LinenThree/second" in table.first_overflow
    text = str(table)
    assert "<- first overflow" in text.splitlines()[3] and "(carries it)" in text, text
    assert "first overflow: forward dot_general" in text
    assert [r.headroom for r in table.rows] == sorted(r.headroom for r in table.rows)
    healthy = ls.float16_report(loss_of(LinenNet().apply), *make("linen", 0.5)[1:2],
                                jnp.ones((1, 4), F16))
    assert healthy.first_overflow is None and not any(r.overflow for r in healthy.rows)


@jax.custom_jvp
def amplify(x):
    """The identity; its rule multiplies the tangent by 100, then by 1024, in float16."""
    return x


@amplify.defjvp
def _amplify_jvp(primals, tangents):
    return primals[0], tangents[0] * F16(100) * F16(1024)


def amplified_loss(w, x):
    return jnp.sum(amplify(w.astype(F16) * x).astype(F32))


def test_an_overflow_only_the_compiled_step_has_is_reported_as_such():
    """Op by op the cotangent 0.25 becomes 256, then 25600: finite. XLA folds 100 * 1024
    first, in float16: inf, so the compiled gradient is inf (the premise, checked)."""
    w, x, scale = jnp.ones(1), jnp.ones(1, F16), 0.25
    eager = jax.grad(lambda w: amplified_loss(w, x) * scale)(w)
    compiled = jax.jit(jax.grad(lambda w, s: amplified_loss(w, x) * s))(w, scale)
    assert float(eager[0]) == 25600.0 and not np.isfinite(compiled).any()
    report = ls.find_overflow(amplified_loss, w, x, scale=scale)
    assert not report.found and report.phase is None  # no equation of the jaxpr overflows
    assert report and report.compiled_finite is False, report  # but the step does
    assert report.compiled_nonfinite == ("",), report  # the one leaf: the params
    text = str(report)
    assert "op-by-op run finds the loss and every gradient" in text, text
    assert "compiled step does not" in text and "100 * 1024" in text, text
    # where they agree, nothing more is said
    healthy = ls.find_overflow(lambda w, x: jnp.sum((w.astype(F16) * x).astype(F32)), w, x)
    assert not healthy and healthy.compiled_finite is True
    assert str(healthy).startswith("find_overflow: the loss and every gradient")
    skipped = ls.find_overflow(amplified_loss, w, x, scale=scale, compiled=False)
    assert not skipped and skipped.compiled_finite is None
    # float16_report's rows come from the op-by-op run: its notes say they disagree, and
    # the verdict follows the compiled step (inf times any scale's cotangent)
    table = ls.float16_report(amplified_loss, w, x, scale=scale)
    assert table.fits is False and table.max_scale is None, table
    assert all(np.isfinite(r.headroom) for r in table.rows), table
    assert any("compiled step is not finite while the op-by-op run the rows come from is"
               in n for n in table.notes), table.notes


def test_both_agree_on_an_overflow_and_the_text_says_it_once():
    loss_fn, model, _ = make("plain", BIG)
    report = ls.find_overflow(loss_fn, model, jnp.ones((1, 4), F16))
    assert report.found and report.compiled_finite is False
    # second's own gradient, its input times the cotangent, is finite
    assert report.compiled_nonfinite == ("loss", "first"), report
    assert "compiled step is not finite either (the loss and the gradients of first)" in str(
        report)


def lowerings(run):
    """The jaxprs lowered to XLA while ``run()`` runs (an eager op's first use counts)."""
    events = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        run()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(events)


def test_a_second_call_with_the_same_shapes_compiles_nothing():
    """The first call compiles the real step and the eager ops of each shape; a second
    call with new values of the same shapes reuses all of it."""
    loss_fn, params, _ = make("plain", AMP)
    x = jnp.full((2, 4), SMALL, F16)
    aux = lambda p, x: (loss_fn(p, x), x)  # noqa: E731
    calls = [lambda p, x: ls.float16_report(loss_fn, p, x),
             lambda p, x: ls.find_overflow(loss_fn, p, x, scale=2.0**15),  # it overflows
             lambda p, x: ls.float16_report(aux, p, x, has_aux=True)]
    for call in calls:  # (what they compile may have been compiled by an earlier test)
        call(params, x)
    assert lowerings(lambda: jax.jit(lambda a: a + 1)(x)) == 1  # the count counts
    other, y = {k: v * 0.5 for k, v in params.items()}, x * 2  # new values, same shapes
    for call in calls:
        assert lowerings(lambda call=call: call(other, y)) == 0


def test_an_argument_the_loss_needs_concrete_is_kept_concrete_in_the_compiled_step():
    """A NumPy array the loss reads as a Python int (a length): the compiled step cannot
    trace it, so it is closed over, as the op-by-op run has it; unhashable arguments
    (a list of callables in a dict) compile for the call only."""
    def loss_fn(w, x, n, fns):
        h = fns["act"][0](x[:int(n)] @ w.astype(F16))
        return jnp.sum(h.astype(F32))

    args = (jnp.full((4, 4), AMP, F32), jnp.full((3, 4), SMALL, F16), np.array(2),
            {"act": [jax.nn.relu]})
    table = ls.float16_report(loss_fn, *args)
    # the float16 cotangent of h is the scale itself: 2**16 is inf
    assert table.fits and table.max_scale == 2.0**15, table
    report = ls.find_overflow(loss_fn, *args, scale=2.0**16)
    assert report.phase == "backward" and report.compiled_finite is False, report


def test_the_compiled_steps_kept_for_later_calls_are_bounded():
    """Each new loss function compiles its step once; the oldest are let go, and with
    them what they hold of the user's (the loss function, its closure)."""
    from loss_scaling.debug import _trace

    x = jnp.ones((1, 4), F16)
    first = lambda p, x: jnp.sum((x @ p.astype(F16)).astype(F32))  # noqa: E731
    held = weakref.ref(first)
    ls.float16_report(first, jnp.eye(4), x)
    for i in range(_trace.CACHE_SIZE):
        ls.float16_report(lambda p, x, i=i: jnp.sum((x @ p.astype(F16)).astype(F32)) + i,
                          jnp.eye(4), x)
    assert len(_trace._compiled) == _trace.CACHE_SIZE
    del first
    gc.collect()
    assert held() is None


class LinenGRU(nn.Module):
    """flax's own GRUCell under nn.RNN: its traceback ends in flax, none of its lines is
    the user's; the user's line is the one that calls nn.RNN."""

    @nn.compact
    def __call__(self, xs):
        cell = nn.GRUCell(4, dtype=F16, param_dtype=F32,
                          recurrent_kernel_init=lambda *_: 14.0 * jnp.eye(4))
        h = nn.RNN(cell)(xs)  # <- rnn
        return h[:, -1]


def test_a_frameworks_own_cell_is_placed_at_the_users_line_that_calls_it():
    model = LinenGRU()
    xs = jnp.zeros((1, 8, 2), F16)
    params = model.init(jax.random.key(0), xs)
    report = ls.find_overflow(loss_of(model.apply), params, xs, scale=2.0**10)
    line = next(i + 1 for i, t in enumerate(Path(__file__).read_text().splitlines())
                if t.rstrip().endswith("# <- rnn"))
    assert report.phase == "backward" and report.loops, report
    assert "LinenGRU/RNN_0" in report.layer, report
    assert (report.file, report.line) == (__file__, line), report
    assert "None:None" not in str(report)


# ------------------------------------------------------ nothing of it in the train step

STEP_TEXT = textwrap.dedent('''
    import sys, jax, jax.numpy as jnp, optax
    from flax import nnx
    import loss_scaling as ls

    def step_text():
        model = nnx.Linear(4, 4, dtype=jnp.float16, rngs=nnx.Rngs(0))
        tx = ls.with_loss_scaling(optax.adam(1e-3), ls.DynamicLossScale())
        optimizer = ls.nnx.Optimizer(model, tx, wrt=nnx.Param)
        loss_fn = lambda m, x: jnp.sum(m(x).astype(jnp.float32))

        @nnx.jit
        def train_step(optimizer, model, x):
            loss, grads = ls.value_and_grad(loss_fn)(optimizer, model, x)
            optimizer.update(model, grads)
            return loss

        x = jnp.ones((2, 4), jnp.float16)
        text = train_step.lower(optimizer, model, x).as_text(debug_info=True)
        return text, (loss_fn, optimizer, model, x)

    def fused_step_text():  # the fused path: ls.apply_gradients, plain params
        params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
        tx = ls.with_loss_scaling(optax.adam(1e-3), ls.DynamicLossScale())
        loss_fn = lambda p, x: jnp.sum((x @ p["w"].astype(jnp.float16)).astype(jnp.float32))

        @jax.jit
        def train_step(params, opt_state, x):
            loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, x)
            return ls.apply_gradients(tx, grads, opt_state, params, loss=loss)

        x = jnp.ones((2, 4), jnp.float16)
        opt_state = tx.init(params)
        return train_step.lower(params, opt_state, x).as_text(debug_info=True), (
            loss_fn, opt_state, params, x)

    texts = []
    for use_the_feature in (False, True):  # one call site: the locations are the same
        if use_the_feature:
            assert "loss_scaling.debug" not in sys.modules
            assert ls.find_overflow(*args).phase == "backward"  # 2 * 2**15 in float16
            ls.float16_report(*args)  # it compiles the real step of its own
            assert ls.find_overflow(*fused_args).phase == "backward"
            ls.float16_report(*fused_args)
        text, args = step_text()
        fused, fused_args = fused_step_text()
        texts.append(text + fused)
    assert "callback" not in texts[1]
    print(texts[0] == texts[1])
''')


def test_the_train_steps_compiled_text_is_unchanged_by_the_feature():
    proc = subprocess.run([sys.executable, "-c", STEP_TEXT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"


def test_check_failure_messages_point_to_both_tools():
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(init_scale=2.0**-125))
    params = {"w": jnp.ones(2)}
    step = jax.jit(lambda p, s, g: ls.apply_gradients(tx, g, s, p))
    state = tx.init(params)
    for _ in range(2):
        params, state = step(params, state, {"w": jnp.array([jnp.inf, 1.0])})
    with pytest.raises(ls.LossScaleError) as error:
        ls.check(state)
    skips = ls.with_loss_scaling(optax.sgd(0.1), max_consecutive_skips=1)
    skip_state = skips.init(params)
    _, skip_state = jax.jit(lambda p, s, g: ls.apply_gradients(skips, g, s, p))(
        params, skip_state, {"w": jnp.array([jnp.nan, 1.0])})
    with pytest.raises(ls.LossScaleError) as too_many:
        ls.check(skip_state)
    for message in (str(error.value), str(too_many.value)):
        assert "loss_scaling.find_overflow" in message
        assert "loss_scaling.float16_report" in message


def test_a_forward_overflow_names_the_autocast_policy_fix_and_the_fix_works():
    def loss_fn(w, x, dtype=jnp.float16):
        h = x.astype(dtype) @ w.astype(dtype)  # 300 * 100 * 4 = 120,000: past 65,504
        return jnp.mean((h / 1e4).astype(jnp.float32))

    w, x = jnp.full((4, 3), 300.0), jnp.full((2, 4), 100.0)
    report = ls.find_overflow(loss_fn, w, x, scale=1.0)
    assert report.phase == "forward"
    assert "ls.autocast(loss_fn, policy=ls.autocast_report(loss_fn, *args).policy)" in str(
        report)
    assert "ls.autocast(loss_fn, policy=" in str(ls.float16_report(loss_fn, w, x))
    # the fix, on the same model written in float32
    float32_fn = functools.partial(loss_fn, dtype=jnp.float32)
    policy = ls.autocast_report(float32_fn, w, x).policy
    assert not np.isfinite(float(ls.autocast(float32_fn)(w, x)))
    fixed = ls.autocast(float32_fn, policy=policy)(w, x)
    np.testing.assert_allclose(fixed, float32_fn(w, x), rtol=1e-3)
    # a backward overflow is the loss scale's to fix: no autocast advice
    small = ls.find_overflow(lambda w, x: jnp.mean(x.astype(jnp.float16) @ w.astype(
        jnp.float16)).astype(jnp.float32), w / 300, x / 100, scale=2.0**20)
    assert small.phase == "backward" and "ls.autocast(" not in str(small)
