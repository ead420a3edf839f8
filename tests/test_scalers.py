"""The three loss-scale states: validation, pytree behaviour, and the update rule.

Randomized checks of the update rule against a reference model live in
``test_update_rule.py``; this file holds the table-driven and known-value tests.
"""

from __future__ import annotations

import dataclasses
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import loss_scaling as ls

TINY = float(np.finfo(np.float32).tiny)
NAN = float("nan")
INF = float("inf")

MAYBE_JIT = pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])

# A DynamicLossScale with a non-default value in every configuration field.
CUSTOM_CONFIG = dict(
    init_scale=256.0,
    growth_factor=3.0,
    backoff_factor=0.25,
    growth_interval=7,
    hysteresis=3,
    min_scale=0.125,
    max_scale=2.0**20,
)


def custom_dynamic() -> ls.DynamicLossScale:
    """A state whose every config field *and* every leaf differs from the defaults."""
    s = ls.DynamicLossScale(**CUSTOM_CONFIG)
    s = ls.update(s, True)          # growth_tracker 1
    s = ls.update(s, True)          # growth_tracker 2
    s = ls.update(s, False)         # growth_tracker 0, nonfinite_tracker 1
    s = ls.update(s, True)          # growth_tracker 1, nonfinite_tracker 0
    s = ls.update(s, False)         # nonfinite_tracker 1
    s = ls.update(s, False)         # nonfinite_tracker 2
    s = ls.update(s, True)          # growth_tracker 1
    s = ls.update(s, True)          # growth_tracker 2
    s = ls.update(s, True)          # growth_tracker 3
    s = ls.update(s, False)         # nonfinite_tracker 1
    s = ls.update(s, False)         # nonfinite_tracker 2
    s = ls.update(s, False)         # 3rd in a row: backoff 256 -> 64, growth_tracker 0
    # Put a non-zero value in every leaf at once (unflattening never validates).
    return jax.tree.unflatten(
        jax.tree.structure(s), [jnp.float32(64.0), jnp.int32(5), jnp.int32(2), jnp.int32(0)])


def all_kinds() -> list:
    return [ls.NoOpLossScale(), ls.StaticLossScale(512.0), custom_dynamic()]


KIND_IDS = ["noop", "static", "dynamic"]


def config_of(s) -> dict:
    """Everything about a state that is not a leaf value."""
    if isinstance(s, ls.DynamicLossScale):
        return dict(
            growth_factor=s.growth_factor,
            backoff_factor=s.backoff_factor,
            growth_interval=s.growth_interval,
            hysteresis=s.hysteresis,
            min_scale=s.min_scale,
            max_scale=s.max_scale,
        )
    return {}


def assert_same_state(a, b) -> None:
    assert type(a) is type(b)
    assert config_of(a) == config_of(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    chex.assert_trees_all_equal(a, b)
    chex.assert_trees_all_equal_dtypes(a, b)


# ------------------------------------------------------------------------------ validation

# (constructor kwargs, argument the message must name, text of the value it must show)
INVALID_DYNAMIC = [
    (dict(init_scale=INF), "init_scale", "inf"),
    (dict(init_scale=-INF), "init_scale", "-inf"),
    (dict(init_scale=NAN), "init_scale", "nan"),
    (dict(init_scale=0.0), "init_scale", "0.0"),
    (dict(init_scale=-1.0), "init_scale", "-1.0"),
    (dict(init_scale=1e-45), "init_scale", "1e-45"),     # subnormal as float32
    (dict(init_scale=1e-39), "init_scale", "1e-39"),     # subnormal as float32
    (dict(init_scale=1e39), "init_scale", "1e+39"),      # overflows float32
    (dict(init_scale=True), "init_scale", "True"),
    (dict(init_scale="1024"), "init_scale", "'1024'"),
    (dict(init_scale=None), "init_scale", "None"),
    (dict(init_scale=1 + 1j), "init_scale", "(1+1j)"),
    (dict(growth_factor=NAN), "growth_factor", "nan"),
    (dict(growth_factor=INF), "growth_factor", "inf"),
    (dict(growth_factor=1.0), "growth_factor", "1.0"),
    (dict(growth_factor=0.5), "growth_factor", "0.5"),
    (dict(growth_factor=1.00000001), "growth_factor", "1.00000001"),  # 1.0 in float32
    (dict(growth_factor=1e39), "growth_factor", "1e+39"),             # inf in float32
    (dict(growth_factor=False), "growth_factor", "False"),
    (dict(growth_factor="2"), "growth_factor", "'2'"),
    (dict(backoff_factor=0.0), "backoff_factor", "0.0"),
    (dict(backoff_factor=1.0), "backoff_factor", "1.0"),
    (dict(backoff_factor=-0.5), "backoff_factor", "-0.5"),
    (dict(backoff_factor=1.5), "backoff_factor", "1.5"),
    (dict(backoff_factor=NAN), "backoff_factor", "nan"),
    (dict(backoff_factor=0.999999999), "backoff_factor", "0.999999999"),  # 1.0 in float32
    (dict(backoff_factor=1e-46), "backoff_factor", "1e-46"),              # 0.0 in float32
    (dict(backoff_factor=None), "backoff_factor", "None"),
    (dict(growth_interval=0), "growth_interval", "0"),
    (dict(growth_interval=-1), "growth_interval", "-1"),
    (dict(growth_interval=2.5), "growth_interval", "2.5"),
    (dict(growth_interval=2.0), "growth_interval", "2.0"),
    (dict(growth_interval=True), "growth_interval", "True"),
    (dict(growth_interval=2**31), "growth_interval", str(2**31)),
    (dict(growth_interval="10"), "growth_interval", "'10'"),
    (dict(hysteresis=0), "hysteresis", "0"),
    (dict(hysteresis=-2), "hysteresis", "-2"),
    (dict(hysteresis=1.5), "hysteresis", "1.5"),
    (dict(hysteresis=False), "hysteresis", "False"),
    (dict(min_scale=0.0), "min_scale", "0.0"),
    (dict(min_scale=NAN), "min_scale", "nan"),
    (dict(min_scale=1e-45), "min_scale", "1e-45"),
    (dict(min_scale=-1.0), "min_scale", "-1.0"),
    (dict(min_scale="1"), "min_scale", "'1'"),
    (dict(init_scale=2.0, min_scale=4.0), "min_scale", "4.0"),
    (dict(max_scale=0.0), "max_scale", "0.0"),
    (dict(max_scale=INF), "max_scale", "inf"),
    (dict(max_scale=NAN), "max_scale", "nan"),
    (dict(max_scale=1e39), "max_scale", "1e+39"),
    (dict(init_scale=8.0, max_scale=4.0), "max_scale", "4.0"),
    # max_scale < min_scale: inconsistent with init_scale whatever it is.
    (dict(init_scale=3.0, min_scale=4.0, max_scale=2.0), "(min|max)_scale", r"(4\.0|2\.0)"),
    (dict(init_scale=3.0, min_scale=2.0, max_scale=1.0), "(min|max)_scale", r"(2\.0|1\.0)"),
]


@pytest.mark.parametrize(
    ("kwargs", "name", "shown"), INVALID_DYNAMIC, ids=[repr(k) for k, _, _ in INVALID_DYNAMIC])
def test_dynamic_invalid_argument_raises_value_error_naming_it(kwargs, name, shown):
    with pytest.raises(ValueError) as info:
        ls.DynamicLossScale(**kwargs)
    message = str(info.value)
    if name.startswith("("):
        assert re.search(name, message), message
        assert re.search(shown, message), message
    else:
        assert name in message, message
        assert shown in message, message


INVALID_STATIC = [0.0, -1.0, INF, NAN, 1e-45, 1e-39, 1e39, "a", None, True]


@pytest.mark.parametrize("value", INVALID_STATIC, ids=repr)
def test_static_invalid_scale_raises_value_error_naming_it(value):
    with pytest.raises(ValueError) as info:
        ls.StaticLossScale(value)
    message = str(info.value)
    assert "loss_scale" in message, message
    assert repr(value) in message, message


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(init_scale=TINY),                              # smallest normal float32
        dict(init_scale=float(np.finfo(np.float32).max)),  # largest float32
        dict(init_scale=1, growth_factor=2, growth_interval=np.int64(3)),  # ints are fine
        dict(init_scale=np.float32(8.0), growth_factor=np.float64(1.5)),
        dict(growth_interval=1, hysteresis=1),
        dict(growth_interval=2**31 - 1),
        dict(init_scale=4.0, min_scale=4.0, max_scale=4.0),
        dict(**CUSTOM_CONFIG),
    ],
    ids=repr,
)
def test_dynamic_valid_arguments(kwargs):
    s = ls.DynamicLossScale(**kwargs)
    assert s.loss_scale.dtype == jnp.float32
    assert s.growth_tracker.dtype == jnp.int32
    assert s.nonfinite_tracker.dtype == jnp.int32
    assert s.loss_scale.shape == s.growth_tracker.shape == s.nonfinite_tracker.shape == ()
    assert int(s.growth_tracker) == int(s.nonfinite_tracker) == 0
    assert isinstance(s.growth_interval, int)
    assert isinstance(s.hysteresis, int)


def test_dynamic_defaults_follow_the_seed():
    s = ls.DynamicLossScale()
    assert float(s.loss_scale) == 2.0**15
    assert s.growth_factor == 2.0
    assert s.backoff_factor == 0.5
    assert s.growth_interval == 2000
    assert s.hysteresis == 1
    assert s.min_scale is None
    assert s.max_scale is None


def test_static_and_noop_loss_scale_values():
    assert float(ls.StaticLossScale(128.0).loss_scale) == 128.0
    assert ls.StaticLossScale(128.0).loss_scale.dtype == jnp.float32
    assert float(ls.NoOpLossScale().loss_scale) == 1.0
    assert ls.NoOpLossScale().loss_scale.dtype == jnp.float32


def test_construction_refuses_traced_values():
    def build(x):
        return ls.DynamicLossScale(init_scale=x).loss_scale

    with pytest.raises(ValueError, match="init_scale"):
        jax.jit(build)(1024.0)


# ---------------------------------------------------------------------------- pytrees


@pytest.mark.parametrize("s", all_kinds(), ids=KIND_IDS)
def test_flatten_unflatten_identity(s):
    leaves, treedef = jax.tree.flatten(s)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert_same_state(rebuilt, s)
    leaves2, treedef2 = jax.tree.flatten(rebuilt)
    assert treedef2 == treedef
    assert all(a is b for a, b in zip(leaves, leaves2, strict=True))


def test_flatten_unflatten_keeps_every_dynamic_field():
    s = custom_dynamic()
    leaves, treedef = jax.tree.flatten(s)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert config_of(rebuilt) == dict(
        growth_factor=3.0, backoff_factor=0.25, growth_interval=7, hysteresis=3,
        min_scale=0.125, max_scale=2.0**20)
    assert float(rebuilt.loss_scale) == 64.0
    assert int(rebuilt.growth_tracker) == 5
    assert int(rebuilt.nonfinite_tracker) == 2
    # A different configuration is a different tree structure (no silent mixing).
    assert jax.tree.structure(ls.DynamicLossScale(init_scale=64.0)) != treedef


def test_custom_dynamic_reached_through_updates():
    """The scripted updates in `custom_dynamic` do what their comments say."""
    s = ls.DynamicLossScale(**CUSTOM_CONFIG)
    expected = [  # (finite, scale, growth_tracker, nonfinite_tracker)
        (True, 256.0, 1, 0), (True, 256.0, 2, 0), (False, 256.0, 0, 1), (True, 256.0, 1, 0),
        (False, 256.0, 0, 1), (False, 256.0, 0, 2), (True, 256.0, 1, 0), (True, 256.0, 2, 0),
        (True, 256.0, 3, 0), (False, 256.0, 0, 1), (False, 256.0, 0, 2), (False, 64.0, 0, 3),
    ]
    for finite, scale, tracker, streak in expected:
        s = ls.update(s, finite)
        assert (float(s.loss_scale), int(s.growth_tracker), int(s.nonfinite_tracker)) == (
            scale, tracker, streak)


@pytest.mark.parametrize("s", all_kinds(), ids=KIND_IDS)
def test_tree_map_to_none_does_not_validate(s):
    nones = jax.tree.map(lambda _: None, s)
    assert type(nones) is type(s)
    assert config_of(nones) == config_of(s)
    assert jax.tree.leaves(nones) == []
    if not isinstance(s, ls.NoOpLossScale):
        assert nones.loss_scale is None
    # And back: the None tree is a valid prefix / structure for further maps.
    assert jax.tree.structure(jax.tree.map(lambda _: 0, s)) == jax.tree.structure(s)


@pytest.mark.parametrize("s", all_kinds(), ids=KIND_IDS)
def test_tree_map_to_shape_dtype_struct(s):
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), s)
    assert type(abstract) is type(s)
    assert config_of(abstract) == config_of(s)
    for leaf in jax.tree.leaves(abstract):
        assert isinstance(leaf, jax.ShapeDtypeStruct)
    # An abstract state drives tracing and lowering.
    out = jax.eval_shape(lambda st: ls.update(st, True), abstract)
    assert jax.tree.structure(out) == jax.tree.structure(s)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(out)] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(s)]
    jax.jit(ls.update).lower(abstract, jax.ShapeDtypeStruct((), jnp.bool_)).compile()


@pytest.mark.parametrize("s", all_kinds(), ids=KIND_IDS)
def test_tree_map_to_partition_spec_and_shardings(s):
    specs = jax.tree.map(lambda _: PartitionSpec(), s)
    assert type(specs) is type(s)
    assert config_of(specs) == config_of(s)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    assert all(p == PartitionSpec() for p in spec_leaves)
    assert len(spec_leaves) == len(jax.tree.leaves(s))
    # The spec tree works as a sharding tree for a jitted step.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    shardings = jax.tree.map(
        lambda p: NamedSharding(mesh, p), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    step = jax.jit(ls.update, in_shardings=(shardings, None), out_shardings=shardings)
    out = step(jax.device_put(s, shardings), jnp.asarray(True))
    assert type(out) is type(s)
    assert config_of(out) == config_of(s)


@pytest.mark.parametrize("s", all_kinds(), ids=KIND_IDS)
def test_jit_identity_keeps_whole_configuration_and_dtypes(s):
    out = jax.jit(lambda st: st)(s)
    assert_same_state(out, s)
    if isinstance(s, ls.DynamicLossScale):
        assert out.min_scale == 0.125        # jmp loses exactly this one
        assert out.max_scale == 2.0**20
        assert out.hysteresis == 3
        assert out.growth_interval == 7
        assert out.growth_factor == 3.0
        assert out.backoff_factor == 0.25
        assert out.growth_tracker.dtype == jnp.int32
        assert out.nonfinite_tracker.dtype == jnp.int32
    assert out.loss_scale.dtype == jnp.float32
    # Leaves are strongly typed: a weakly typed state would retrace a step when it meets
    # an updated (or restored) one.
    for leaf in jax.tree.leaves(s) + jax.tree.leaves(out):
        assert leaf.weak_type is False


def test_jit_keeps_configuration_through_update():
    s = ls.DynamicLossScale(init_scale=4.0, backoff_factor=0.5, min_scale=2.0, max_scale=8.0,
                            growth_interval=1)
    step = jax.jit(ls.update)
    for _ in range(3):
        s = step(s, jnp.asarray(False))
    assert float(s.loss_scale) == 2.0      # min_scale survived the jit boundary
    for _ in range(3):
        s = step(s, jnp.asarray(True))
    assert float(s.loss_scale) == 8.0      # max_scale survived too


def test_flatten_with_path_names_the_leaves():
    paths = [jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(custom_dynamic())[0]]
    assert paths == [".loss_scale", ".growth_tracker", ".nonfinite_tracker", ".failure"]
    paths = [jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(ls.StaticLossScale(2.0))[0]]
    assert paths == [".loss_scale"]
    assert jax.tree_util.tree_flatten_with_path(ls.NoOpLossScale())[0] == []
    # Paths reach the values, as Orbax and optax.tree_utils use them.
    nested = {"scaler": custom_dynamic()}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nested)[0]:
        assert jax.tree_util.keystr(path).startswith("['scaler'].")
        assert getattr(nested["scaler"], path[-1].name) is leaf


@pytest.mark.parametrize("s", all_kinds(), ids=KIND_IDS)
def test_states_are_immutable(s):
    for name in ("loss_scale", "growth_tracker", "nonfinite_tracker", "new_attribute"):
        with pytest.raises(AttributeError):
            setattr(s, name, jnp.float32(1.0))
    with pytest.raises(AttributeError):
        del s.loss_scale
    if isinstance(s, ls.DynamicLossScale):
        with pytest.raises(AttributeError):
            s.min_scale = 1.0
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.config.min_scale = 1.0
    assert float(s.loss_scale) in (1.0, 512.0, 64.0)


@pytest.mark.parametrize("s", all_kinds(), ids=KIND_IDS)
def test_eval_shape(s):
    out = jax.eval_shape(lambda st: st, s)
    assert type(out) is type(s)
    assert config_of(out) == config_of(s)
    out = jax.eval_shape(ls.update, s, True)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(out)] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(s)]
    built = jax.eval_shape(lambda: ls.DynamicLossScale(**CUSTOM_CONFIG))
    assert config_of(built) == config_of(ls.DynamicLossScale(**CUSTOM_CONFIG))
    assert built.loss_scale.dtype == jnp.float32


def test_no_retrace_across_steps():
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(s, finite):
        return ls.update(s, finite)

    s = ls.DynamicLossScale(init_scale=2.0**10, growth_interval=1)
    for finite in [True, True, False, True, False, False, True]:
        s = step(s, jnp.asarray(finite))
    assert float(s.loss_scale) == 2.0**11
    # An eagerly updated state has the same avals: still no retrace.
    s = ls.update(s, True)
    s = ls.update(s, False)
    s = step(s, jnp.asarray(True))
    # A new loss_scale value (a leaf) does not recompile either.
    s = step(ls.DynamicLossScale(init_scale=3.0, growth_interval=1), jnp.asarray(True))
    assert float(s.loss_scale) == 6.0


def test_static_loss_scale_value_does_not_recompile():
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def scaled_loss(s, x):
        return ls.scale(s, x)

    x = jnp.float16(2.0)
    assert float(scaled_loss(ls.StaticLossScale(128.0), x)) == 256.0
    assert float(scaled_loss(ls.StaticLossScale(4.0), x)) == 8.0
    assert float(scaled_loss(ls.StaticLossScale(2.0**-100), x)) == 2.0**-99


def test_eager_update_keeps_leaf_avals():
    """Eager updates never change dtype or weak type (which would retrace a user's jit)."""
    s0 = ls.DynamicLossScale()
    s1 = ls.update(ls.update(s0, True), False)
    for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1), strict=True):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert a.weak_type is False and b.weak_type is False


# ------------------------------------------------------------------------------ update


@MAYBE_JIT
def test_update_known_values(maybe_jit):
    update = maybe_jit(ls.update)
    s = ls.DynamicLossScale(init_scale=1024.0, growth_interval=3)
    trace = []
    for finite in [True, True, True, True, False, True, True, True]:
        s = update(s, finite)
        trace.append((float(s.loss_scale), int(s.growth_tracker)))
    assert trace == [
        (1024.0, 1), (1024.0, 2), (2048.0, 0),   # grows on the 3rd clean step
        (2048.0, 1), (1024.0, 0),                # backs off, tracker reset
        (1024.0, 1), (1024.0, 2), (2048.0, 0),
    ]


@MAYBE_JIT
def test_growth_interval_one_grows_every_clean_step(maybe_jit):
    update = maybe_jit(ls.update)
    s = ls.DynamicLossScale(init_scale=1.0, growth_interval=1)
    for expected in [2.0, 4.0, 8.0]:
        s = update(s, True)
        assert float(s.loss_scale) == expected
        assert int(s.growth_tracker) == 0


@MAYBE_JIT
def test_growth_overflow_is_skipped_and_tracker_resets(maybe_jit):
    update = maybe_jit(ls.update)
    big = float(np.finfo(np.float32).max) / 1.5
    s = ls.DynamicLossScale(init_scale=big, growth_interval=2)
    s = update(s, True)
    assert int(s.growth_tracker) == 1
    s = update(s, True)
    assert float(s.loss_scale) == float(np.float32(big))
    assert math.isfinite(float(s.loss_scale))
    assert int(s.growth_tracker) == 0


@MAYBE_JIT
def test_max_scale_caps_growth(maybe_jit):
    update = maybe_jit(ls.update)
    s = ls.DynamicLossScale(init_scale=3.0, growth_interval=1, max_scale=10.0)
    s = update(s, True)
    assert float(s.loss_scale) == 6.0
    s = update(s, True)
    assert float(s.loss_scale) == 10.0
    s = update(s, True)
    assert float(s.loss_scale) == 10.0
    # Capped at float32 max instead of skipped when max_scale is the float32 max.
    f32_max = float(np.finfo(np.float32).max)
    s = ls.DynamicLossScale(init_scale=2.0**127, growth_interval=1, max_scale=f32_max)
    assert float(update(s, True).loss_scale) == f32_max


@MAYBE_JIT
def test_hysteresis_backs_off_on_hth_consecutive_nonfinite_step(maybe_jit):
    update = maybe_jit(ls.update)
    s = ls.DynamicLossScale(init_scale=64.0, hysteresis=3, growth_interval=100)
    trace = []
    for finite in [False, False, True, False, False, False, False, True, False]:
        s = update(s, finite)
        trace.append((float(s.loss_scale), int(s.nonfinite_tracker), int(s.growth_tracker)))
    assert trace == [
        (64.0, 1, 0), (64.0, 2, 0),
        (64.0, 0, 1),                            # a clean step refills the hysteresis
        (64.0, 1, 0), (64.0, 2, 0), (32.0, 3, 0),
        (16.0, 3, 0),                            # every further non-finite step backs off
        (16.0, 0, 1), (16.0, 1, 0),
    ]


@MAYBE_JIT
@pytest.mark.parametrize("s", [ls.NoOpLossScale(), ls.StaticLossScale(8.0)], ids=["noop", "static"])
def test_update_leaves_noop_and_static_unchanged(maybe_jit, s):
    update = maybe_jit(ls.update)
    for finite in [True, False, jnp.asarray(False), np.bool_(True)]:
        out = update(s, finite)
        assert type(out) is type(s)
        assert float(out.loss_scale) == float(s.loss_scale)
    assert ls.update(s, False) is s


@MAYBE_JIT
@pytest.mark.parametrize("finite", [True, False, np.bool_(True), jnp.asarray(False),
                                    np.asarray(True)], ids=repr)
def test_update_accepts_scalar_bools(maybe_jit, finite):
    s = maybe_jit(ls.update)(ls.DynamicLossScale(init_scale=4.0, growth_interval=1), finite)
    assert float(s.loss_scale) == (8.0 if bool(finite) else 2.0)


BAD_FLAGS = [
    jnp.array([True, True]),
    np.array([True]),
    jnp.int32(1),
    jnp.array(1.0),
    1,
    1.0,
    None,
    "yes",
]


@pytest.mark.parametrize("s", all_kinds(), ids=KIND_IDS)
@pytest.mark.parametrize("flag", BAD_FLAGS, ids=repr)
def test_update_rejects_non_scalar_bool_flags(s, flag):
    with pytest.raises(ValueError, match="grads_finite"):
        ls.update(s, flag)


@pytest.mark.parametrize("flag", [jnp.array([True, False]), jnp.int32(1)], ids=repr)
def test_update_rejects_bad_flags_under_jit(flag):
    with pytest.raises(ValueError, match="grads_finite"):
        jax.jit(ls.update)(ls.DynamicLossScale(), flag)


@pytest.mark.parametrize(
    "state", [None, 1.0, {"loss_scale": 1.0}, jnp.float32(1.0), ls.DynamicLossScale],
    ids=repr)
def test_update_rejects_non_scaler_state(state):
    with pytest.raises(TypeError, match="state"):
        ls.update(state, True)


# ---------------------------------------------------------------------- fail closed


def test_eager_backoff_below_tiny_raises_loss_scale_error():
    s = ls.DynamicLossScale(init_scale=2.0**-126, backoff_factor=0.5)
    assert float(s.loss_scale) == TINY
    with pytest.raises(ls.LossScaleError, match="loss scale") as info:
        ls.update(s, False)
    assert "backoff_factor" in str(info.value)
    assert "min_scale" in str(info.value)            # the message gives the fix
    assert isinstance(info.value, RuntimeError)
    # The state itself is untouched and a healthy step still works.
    assert float(s.loss_scale) == TINY
    assert float(ls.update(s, True).loss_scale) == TINY


def test_eager_fail_closed_reached_through_a_run_of_backoffs():
    s = ls.DynamicLossScale(init_scale=2.0**-120, backoff_factor=0.5)
    for _ in range(6):
        s = ls.update(s, False)
    assert float(s.loss_scale) == TINY
    with pytest.raises(ls.LossScaleError):
        ls.update(s, False)


def test_eager_fail_closed_waits_for_hysteresis():
    s = ls.DynamicLossScale(init_scale=TINY, hysteresis=2)
    s = ls.update(s, False)                          # hysteresis absorbs the first one
    assert float(s.loss_scale) == TINY
    with pytest.raises(ls.LossScaleError):
        ls.update(s, False)


def test_jit_backoff_below_tiny_is_recorded_sticky_and_checked_on_the_host():
    s = ls.DynamicLossScale(init_scale=2.0**-126, backoff_factor=0.5)
    step = jax.jit(ls.update)
    failed = jax.block_until_ready(step(s, jnp.asarray(False)))   # no raise inside jit
    assert int(failed.failure) == ls.Failure.BACKOFF_UNDERFLOW
    assert float(failed.loss_scale) == TINY                         # the last valid scale
    for finite in (True, False, True):                               # sticky: frozen
        again = step(failed, jnp.asarray(finite))
        chex.assert_trees_all_equal(again, failed)
    with pytest.raises(ls.LossScaleError, match=r"loss scale 1\.17549435\d*e-38 times "
                       r"backoff_factor 0\.5 gives 5\.87747\d*e-39"):
        ls.check(failed)
    # The same compiled step still runs healthy states afterwards.
    out = jax.block_until_ready(step(s, jnp.asarray(True)))
    assert float(out.loss_scale) == TINY and int(out.failure) == 0
    assert ls.check(out) is None


def test_jit_fail_closed_inside_a_user_train_step():
    @jax.jit
    def train_step(s, g):
        finite = ls.all_finite(ls.unscale(s, g))
        return ls.update(s, finite)

    s = ls.DynamicLossScale(init_scale=2.0**-126)
    failed = train_step(s, jnp.array([jnp.nan], jnp.float16))
    with pytest.raises(ls.LossScaleError, match="loss scale backoff failed"):
        ls.check(failed)


def test_eager_update_of_a_failed_state_raises_again():
    failed = jax.jit(ls.update)(ls.DynamicLossScale(init_scale=TINY), False)
    with pytest.raises(ls.LossScaleError, match="loss scale backoff failed"):
        ls.update(failed, True)


@pytest.mark.parametrize("bad", [-32768.0, 0.0, float("nan"), float("inf"), 1e-40])
@MAYBE_JIT
def test_an_unvalidated_invalid_scale_fails_closed(maybe_jit, bad):
    """A scale that never passed validation (tree_unflatten, pickle, an unchecked restore)."""
    s = ls.DynamicLossScale()
    bad_state = jax.tree.unflatten(jax.tree.structure(s), [jnp.float32(bad), jnp.int32(0),
                                                           jnp.int32(0), jnp.int32(0)])
    if maybe_jit is jax.jit:
        out = jax.jit(ls.update)(bad_state, jnp.asarray(True))
        assert int(out.failure) == ls.Failure.INVALID_SCALE
        with pytest.raises(ls.LossScaleError, match="not a finite, positive, normal float32"):
            ls.check(out)
    else:
        with pytest.raises(ls.LossScaleError, match="not a finite, positive, normal float32"):
            ls.update(bad_state, True)
    static = jax.tree.unflatten(jax.tree.structure(ls.StaticLossScale(2.0)), [jnp.float32(bad)])
    with pytest.raises(ls.LossScaleError, match=re.escape(repr(float(np.float32(bad))))
                       if np.isfinite(bad) and bad != 0 else "float32"):
        ls.check(static)


def test_on_failure_raise_raises_from_the_compiled_step():
    """The opt-in immediate raise, and what the user sees (documented in the guide)."""
    s = ls.DynamicLossScale(init_scale=2.0**-126, backoff_factor=0.5)
    step = jax.jit(lambda s, f: ls.update(s, f, on_failure="raise"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="loss scale backoff failed") as info:
        jax.block_until_ready(step(s, jnp.asarray(False)))
    assert "LossScaleError" in str(info.value)
    out = jax.block_until_ready(step(s, jnp.asarray(True)))
    assert float(out.loss_scale) == TINY


def test_the_pre_release_runtime_check_keyword_is_gone_and_on_failure_is_checked():
    s = ls.DynamicLossScale(init_scale=TINY)
    with pytest.raises(TypeError, match="runtime_check"):
        ls.update(s, False, runtime_check=True)
    with pytest.raises(TypeError, match="runtime_check"):
        ls.with_loss_scaling(optax.sgd(1.0), runtime_check=False)
    with pytest.raises(ValueError, match="on_failure must be 'record'.*got 'loud'"):
        ls.update(s, True, on_failure="loud")


@MAYBE_JIT
def test_min_scale_clamps_backoff_instead_of_failing(maybe_jit):
    update = maybe_jit(ls.update)
    s = ls.DynamicLossScale(init_scale=2.0**-126, min_scale=2.0**-126)
    for _ in range(3):
        s = update(s, jnp.asarray(False))
        assert float(s.loss_scale) == TINY
    s = ls.DynamicLossScale(init_scale=1.0, backoff_factor=0.5, min_scale=0.3)
    s = update(s, False)
    assert float(s.loss_scale) == 0.5
    s = update(s, False)
    assert float(s.loss_scale) == float(np.float32(0.3))
    s = update(s, False)
    assert float(s.loss_scale) == float(np.float32(0.3))


def test_healthy_steps_under_jit():
    step = jax.jit(ls.update)
    s = ls.DynamicLossScale(init_scale=2.0**-126, growth_interval=2)
    for _ in range(10):
        s = step(s, jnp.asarray(True))
    assert float(s.loss_scale) == 2.0**-121
    s = step(s, jnp.asarray(False))
    assert float(s.loss_scale) == 2.0**-122


def _callback_paths(jaxpr, outer=()):
    """Yields, for each debug_callback eqn, the primitive names enclosing it."""
    for eqn in jaxpr.eqns:
        if "callback" in eqn.primitive.name:
            yield outer
        for param in eqn.params.values():
            subs = param if isinstance(param, (tuple, list)) else (param,)
            for sub in subs:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _callback_paths(inner, (*outer, eqn.primitive.name))


def test_the_default_jitted_update_compiles_no_callback():
    s = ls.DynamicLossScale(init_scale=2.0**-120)
    for fn in (ls.update, lambda st, g: ls.update(st, ls.all_finite(g))):
        jaxpr = jax.make_jaxpr(fn)(s, True if fn is ls.update else jnp.ones(3)).jaxpr
        assert not list(_callback_paths(jaxpr)), "the default step must hold no host callback"
        text = jax.jit(fn).lower(s, True if fn is ls.update else jnp.ones(3)).as_text()
        assert "callback" not in text.lower()


def test_the_opt_in_raise_calls_back_only_inside_a_cond():
    s = ls.DynamicLossScale(init_scale=2.0**-120)
    update = lambda st, f: ls.update(st, f, on_failure="raise")  # noqa: E731
    jaxpr = jax.make_jaxpr(update)(s, True).jaxpr
    assert not any("callback" in eqn.primitive.name for eqn in jaxpr.eqns)
    paths = list(_callback_paths(jaxpr))
    assert paths and all("cond" in path for path in paths), paths


def test_the_opt_in_raise_survives_when_the_result_is_unused():
    """The raise is an effect: XLA must not drop it even if the new scale is discarded."""

    @jax.jit
    def step(s, finite):
        new = ls.update(s, finite, on_failure="raise")
        return new.growth_tracker

    with pytest.raises(jax.errors.JaxRuntimeError, match="loss scale"):
        jax.block_until_ready(step(ls.DynamicLossScale(init_scale=TINY), jnp.asarray(False)))


# ------------------------------------------------------------------ pickling, dtype switch


@pytest.mark.parametrize("s", all_kinds(), ids=KIND_IDS)
def test_pickle_and_deepcopy_round_trip(s):
    import copy
    import pickle

    for restored in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert type(restored) is type(s)
        assert getattr(restored, "config", None) == getattr(s, "config", None)
        chex.assert_trees_all_equal(restored, s)
        chex.assert_trees_all_equal_dtypes(restored, s)


@pytest.mark.parametrize(
    "dtype, kind",
    [(jnp.float16, ls.DynamicLossScale), ("float16", ls.DynamicLossScale),
     (jnp.bfloat16, ls.NoOpLossScale), (jnp.float32, ls.NoOpLossScale),
     (np.float64, ls.NoOpLossScale)],
)
def test_loss_scale_for_compute_dtype(dtype, kind):
    assert type(ls.loss_scale_for(dtype)) is kind


def test_loss_scale_for_passes_options_to_float16_only():
    s = ls.loss_scale_for(jnp.float16, init_scale=256.0, growth_interval=7)
    assert float(s.loss_scale) == 256.0 and s.growth_interval == 7
    assert isinstance(ls.loss_scale_for(jnp.bfloat16, init_scale=256.0), ls.NoOpLossScale)


@pytest.mark.parametrize("bad", [jnp.int32, "int8", "not-a-dtype", bool])
def test_loss_scale_for_refuses_non_floating_dtypes(bad):
    with pytest.raises(ValueError, match="compute_dtype"):
        ls.loss_scale_for(bad)


@MAYBE_JIT
def test_noop_train_step_compiles_to_the_bare_step(maybe_jit):
    """The bf16/f32 switch: a step written with scale/unscale/update and the NoOp scale
    lowers to exactly the HLO of the same step written without them."""
    scaler = ls.loss_scale_for(jnp.bfloat16)
    loss_fn = lambda w, x: jnp.sum((x @ w) ** 2)  # noqa: E731

    def with_scaling(w, x, s):
        grads = jax.grad(lambda w: ls.scale(s, loss_fn(w, x)))(w)
        grads = ls.unscale(s, grads)
        return w - 0.1 * grads, ls.update(s, jnp.asarray(True))

    def without(w, x, s):
        return w - 0.1 * jax.grad(loss_fn)(w, x), s

    w, x = jnp.ones((4, 3), jnp.bfloat16), jnp.ones((2, 4), jnp.bfloat16)
    hlo = [jax.jit(f).lower(w, x, scaler).as_text() for f in (with_scaling, without)]
    count = lambda text: len([ln for ln in text.splitlines() if " = " in ln])  # noqa: E731
    assert count(hlo[0]) == count(hlo[1])
    chex.assert_trees_all_equal(maybe_jit(with_scaling)(w, x, scaler)[0],
                                maybe_jit(without)(w, x, scaler)[0])


# ------------------------------- ls.check on a scale that arrived without validation


def _with_scale(s, value, replicas=None):
    """``s`` with its scale replaced, without validation (as unflatten or tree.map do)."""
    leaves = jax.tree.leaves(s)
    scale = jnp.float32(value) if replicas is None else jnp.array(
        [2.0] * (replicas - 1) + [value], jnp.float32)
    rest = leaves[1:] if replicas is None else [
        jnp.broadcast_to(x, (replicas,)) for x in leaves[1:]]
    return jax.tree.unflatten(jax.tree.structure(s), [scale, *rest])


@pytest.mark.parametrize("value", [math.nan, 0.0, -1.0, math.inf, 1e-40])
@pytest.mark.parametrize("where", ["dynamic", "static", "wrapper_dynamic", "wrapper_static",
                                   "replicated_dynamic"])
def test_check_raises_on_an_invalid_scale_of_every_kind_before_any_step(where, value):
    import optax

    kind = ls.StaticLossScale(2.0) if "static" in where else ls.DynamicLossScale()
    if where == "replicated_dynamic":
        state = _with_scale(kind, value, replicas=2)
    elif where.startswith("wrapper"):
        state = ls.with_loss_scaling(optax.sgd(0.1), _with_scale(kind, value)).init(jnp.ones(2))
    else:
        state = _with_scale(kind, value)
    with pytest.raises(ls.LossScaleError, match="not a finite, positive, normal float32"):
        ls.check(state)


# ------------------------------------------------------- one range for every counter

INT32_MAX = 2**31 - 1


@pytest.mark.parametrize("name", ["hysteresis", "growth_interval"])
def test_the_largest_accepted_counter_setting_runs_and_round_trips(name):
    import flax.serialization

    s = ls.DynamicLossScale(init_scale=2.0**20, **{name: INT32_MAX})
    d = ls.state_dict(s)
    tracker = "nonfinite_tracker" if name == "hysteresis" else "growth_tracker"
    d["values"][tracker] = INT32_MAX - 1   # one step from the end of the range
    s = ls.from_state_dict(d)
    finite = name == "growth_interval"
    step = jax.jit(ls.update)
    for _ in range(3):   # reaches the bound, then saturates there: never wraps
        s = step(s, finite)
        restored = ls.from_state_dict(ls.state_dict(s))
        again = ls.from_bytes(ls.DynamicLossScale(**{name: INT32_MAX}),
                              flax.serialization.to_bytes(s))
        for other in (restored, again):
            assert [np.asarray(x).tobytes() for x in jax.tree.leaves(other)] == [
                np.asarray(x).tobytes() for x in jax.tree.leaves(s)]
    if finite:   # the INT32_MAX-th clean step grew the scale, then counting restarted
        assert (float(s.loss_scale), int(s.growth_tracker)) == (2.0**21, 2)
    else:   # hysteresis used up: every non-finite step backs off, the tracker stays put
        assert (float(s.loss_scale), int(s.nonfinite_tracker)) == (2.0**17, INT32_MAX)


@pytest.mark.parametrize("name", ["hysteresis", "growth_interval"])
def test_one_above_the_counter_range_is_refused_naming_argument_value_and_range(name):
    message = re.escape(f"{name} must be an integer in [1, {INT32_MAX}], got {INT32_MAX + 1}")
    with pytest.raises(ValueError, match=message):
        ls.DynamicLossScale(**{name: INT32_MAX + 1})
    d = ls.state_dict(ls.DynamicLossScale())
    d["config"][name] = INT32_MAX + 1
    with pytest.raises(ValueError, match=f"config.{message}"):
        ls.from_state_dict(d)


def test_a_pickle_restores_either_form_and_refuses_a_partial_state():
    """Four leaves: a scaler on its own; three: one a wrapper holds, without ``failure``
    (issue 41: the wrapper's register is the one). Anything else is refused, not
    completed."""
    import pickle

    s = ls.DynamicLossScale(init_scale=8.0)
    reduce_fn, (cls, aux, children) = s.__reduce__()
    assert_restored = reduce_fn(cls, aux, children)
    assert float(assert_restored.loss_scale) == 8.0 and int(assert_restored.failure) == 0
    held = ls.with_loss_scaling(optax.sgd(1.0), s).init(jnp.zeros(2)).scaler
    assert held.leaf_names == ("loss_scale", "growth_tracker", "nonfinite_tracker")
    assert pickle.loads(pickle.dumps(held)).leaf_names == held.leaf_names
    with pytest.raises(ValueError):
        reduce_fn(cls, aux, children[:2])
    assert float(pickle.loads(pickle.dumps(s)).loss_scale) == 8.0
