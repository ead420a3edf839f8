"""Saving and restoring loss-scale states: state dicts, config changes, flax.serialization.

The hostile-input test generates only dicts that are certainly invalid (each is a valid dict
with one mutation that no valid dict can have), so the expectation is always a ValueError.
"""

from __future__ import annotations

import copy
import json
import math
import re

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import loss_scaling as ls
from loss_scaling import (
    check_same_config,
    from_state_dict,
    restore_with_config,
    state_dict,
)

TINY = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)
NAN = float("nan")
INF = float("inf")
INVALID = "invalid loss-scale state dict"

MAYBE_JIT = pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])

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


def config_of(s) -> dict:
    if isinstance(s, ls.DynamicLossScale):
        return {name: getattr(s, name) for name in CONFIG_FIELDS}
    return {}


def assert_bit_identical(a, b) -> None:
    """Same type, configuration, structure, dtypes and bits."""
    assert type(a) is type(b)
    assert config_of(a) == config_of(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert x.tobytes() == y.tobytes()


def assert_plain_json(value) -> None:
    """Only dict (str keys), str, int, float and None: no bools, no numpy, no arrays."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert type(key) is str
            assert_plain_json(item)
    else:
        assert value is None or type(value) in (str, int, float), (value, type(value))


def json_round_trip(d: dict) -> dict:
    return json.loads(json.dumps(d, allow_nan=False))


# ------------------------------------------------------------------------- round trips


@ALL_STATES
def test_state_dict_is_plain_json_with_every_field(make):
    s = make()
    d = state_dict(s)
    assert_plain_json(d)
    assert d["format_version"] == 1
    if isinstance(s, ls.DynamicLossScale):
        assert d["kind"] == "dynamic"
        assert d["config"] == CUSTOM_CONFIG
        assert d["values"] == {
            "loss_scale": float(s.loss_scale),
            "growth_tracker": int(s.growth_tracker),
            "nonfinite_tracker": int(s.nonfinite_tracker),
        }
    elif isinstance(s, ls.StaticLossScale):
        assert d == {"format_version": 1, "kind": "static", "config": {},
                     "values": {"loss_scale": float(np.float32(3.3e4))}}
    else:
        assert d == {"format_version": 1, "kind": "noop", "config": {}, "values": {}}


@ALL_STATES
def test_json_round_trip_is_bit_exact(make):
    s = make()
    restored = from_state_dict(json_round_trip(state_dict(s)))
    assert_bit_identical(restored, s)
    assert state_dict(restored) == state_dict(s)


def test_scale_that_is_not_a_short_decimal_survives_json():
    s = dynamic_after_clean_steps()
    scale = np.float32(s.loss_scale)
    assert scale != np.float32(round(float(scale), 3))   # a genuinely "long" float32
    text = json.dumps(state_dict(s))
    assert np.float32(json.loads(text)["values"]["loss_scale"]).tobytes() == scale.tobytes()


@MAYBE_JIT
@ALL_STATES
def test_restored_state_updates_exactly_like_the_original(make, maybe_jit):
    s = make()
    restored = from_state_dict(json_round_trip(state_dict(s)))
    step = maybe_jit(ls.update)
    for finite in (True, False, False, False, True):
        s, restored = step(s, finite), step(restored, finite)
        assert_bit_identical(restored, s)


def test_restored_state_reuses_the_compiled_step():
    """Same configuration (static aux data) and dtypes: no retrace."""
    s = dynamic_after_overflows()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state):
        return ls.update(state, jnp.asarray(True))

    step(s)
    step(from_state_dict(json_round_trip(state_dict(s))))


def test_state_dict_of_an_updated_state_from_a_jitted_step():
    s = jax.jit(ls.update)(dynamic_after_clean_steps(), False)
    assert state_dict(s)["values"]["nonfinite_tracker"] == 1


def test_ints_are_accepted_where_floats_are_expected():
    d = state_dict(dynamic_after_clean_steps())
    d["config"].update(growth_factor=2, min_scale=1, max_scale=2**20)
    d["values"]["loss_scale"] = 1024
    s = from_state_dict(d)
    assert s.loss_scale.dtype == jnp.float32 and float(s.loss_scale) == 1024.0
    assert (s.growth_factor, s.min_scale, s.max_scale) == (2.0, 1.0, 2.0**20)
    assert isinstance(s.growth_factor, float)


def test_state_dict_refuses_traced_values():
    @jax.jit
    def save(s):
        return state_dict(s)

    with pytest.raises(ValueError, match="concrete"):
        save(dynamic_after_clean_steps())


def test_state_dict_refuses_a_replicated_state_and_says_how():
    s = dynamic_after_clean_steps()
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), s)
    with pytest.raises(ValueError, match=r"shape \(2,\).*x\[0\]"):
        state_dict(stacked)
    assert state_dict(jax.tree.map(lambda x: x[0], stacked)) == state_dict(s)


def test_state_dict_refuses_a_poisoned_scale():
    s = dynamic_after_clean_steps()
    poisoned = jax.tree.unflatten(
        jax.tree.structure(s),
        [jnp.float32(NAN), s.growth_tracker, s.nonfinite_tracker, s.failure])
    with pytest.raises(ValueError, match="loss_scale"):
        state_dict(poisoned)


def test_state_dict_refuses_what_is_not_a_scaler():
    with pytest.raises(TypeError, match="DynamicLossScale"):
        state_dict({"loss_scale": 1.0})


# ----------------------------------------------------------------- corrupted, by table


def base_dict() -> dict:
    return state_dict(dynamic_after_clean_steps())   # scale ~330, trackers (3, 0)


DELETE = object()


def short(value) -> str:
    if value is DELETE:
        return "DELETE"
    if isinstance(value, int) and value.bit_length() > 64:
        return f"int{value.bit_length()}"
    return repr(value)[:30]


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


CORRUPTED = [
    # (path, new value or DELETE, text the message must contain)
    (("values", "loss_scale"), NAN, "values.loss_scale"),
    (("values", "loss_scale"), INF, "values.loss_scale"),
    (("values", "loss_scale"), -INF, "values.loss_scale"),
    (("values", "loss_scale"), 0.0, "values.loss_scale"),
    (("values", "loss_scale"), -0.0, "values.loss_scale"),
    (("values", "loss_scale"), -1024.0, "values.loss_scale"),
    (("values", "loss_scale"), 1e-39, "values.loss_scale"),     # subnormal as float32
    (("values", "loss_scale"), 1e39, "values.loss_scale"),      # inf as float32
    (("values", "loss_scale"), 10**400, "values.loss_scale"),   # beyond float64
    (("values", "loss_scale"), "1024", "values.loss_scale"),
    (("values", "loss_scale"), True, "values.loss_scale"),
    (("values", "loss_scale"), None, "values.loss_scale"),
    (("values", "loss_scale"), [1024.0], "values.loss_scale"),
    (("values", "loss_scale"), 0.0625, "config.min_scale"),     # below min_scale 0.1
    (("values", "loss_scale"), 2.0**21, "config.max_scale"),    # above max_scale
    (("values", "growth_tracker"), -1, "values.growth_tracker"),
    (("values", "growth_tracker"), 5, "values.growth_tracker"),  # == growth_interval
    (("values", "growth_tracker"), 2**40, "values.growth_tracker"),
    (("values", "growth_tracker"), 10**5000, "values.growth_tracker"),
    (("values", "growth_tracker"), 1.5, "values.growth_tracker"),
    (("values", "growth_tracker"), 1.0, "values.growth_tracker"),
    (("values", "growth_tracker"), True, "values.growth_tracker"),
    (("values", "growth_tracker"), "1", "values.growth_tracker"),
    (("values", "growth_tracker"), None, "values.growth_tracker"),
    (("values", "nonfinite_tracker"), -1, "values.nonfinite_tracker"),
    (("values", "nonfinite_tracker"), 4, "values.nonfinite_tracker"),  # > hysteresis
    (("values", "nonfinite_tracker"), 2.0, "values.nonfinite_tracker"),
    (("values", "nonfinite_tracker"), False, "values.nonfinite_tracker"),
    (("config", "growth_factor"), 1.0, "config.growth_factor"),
    (("config", "growth_factor"), 1.00000001, "config.growth_factor"),  # 1.0 as float32
    (("config", "growth_factor"), NAN, "config.growth_factor"),
    (("config", "growth_factor"), INF, "config.growth_factor"),
    (("config", "growth_factor"), "2", "config.growth_factor"),
    (("config", "growth_factor"), None, "config.growth_factor"),
    (("config", "backoff_factor"), 0.0, "config.backoff_factor"),
    (("config", "backoff_factor"), 1.0, "config.backoff_factor"),
    (("config", "backoff_factor"), -0.5, "config.backoff_factor"),
    (("config", "backoff_factor"), 1e-46, "config.backoff_factor"),     # 0.0 as float32
    (("config", "backoff_factor"), {"v": 0.5}, "config.backoff_factor"),
    (("config", "growth_interval"), 0, "config.growth_interval"),
    (("config", "growth_interval"), -3, "config.growth_interval"),
    (("config", "growth_interval"), 2**31, "config.growth_interval"),
    (("config", "growth_interval"), 5.0, "config.growth_interval"),
    (("config", "growth_interval"), True, "config.growth_interval"),
    (("config", "growth_interval"), None, "config.growth_interval"),
    (("config", "growth_interval"), 3, "values.growth_tracker"),   # tracker 3 not below 3
    (("config", "hysteresis"), 0, "config.hysteresis"),
    (("config", "hysteresis"), 1.5, "config.hysteresis"),
    (("config", "min_scale"), 0.0, "config.min_scale"),
    (("config", "min_scale"), NAN, "config.min_scale"),
    (("config", "min_scale"), 1e-40, "config.min_scale"),
    (("config", "min_scale"), "0.1", "config.min_scale"),
    (("config", "min_scale"), 2.0**19, "config.min_scale"),        # above the scale
    (("config", "max_scale"), INF, "config.max_scale"),
    (("config", "max_scale"), False, "config.max_scale"),
    (("config", "max_scale"), 1.0, "config.max_scale"),            # below the scale
    (("kind",), "Dynamic", "kind"),
    (("kind",), "float16", "kind"),
    (("kind",), "static", "config.growth_factor"),   # a dynamic config under kind static
    (("kind",), None, "kind"),
    (("kind",), ["dynamic"], "kind"),
    (("format_version",), 2, "format_version"),
    (("format_version",), 0, "format_version"),
    (("format_version",), 1.0, "format_version"),
    (("format_version",), "1", "format_version"),
    (("format_version",), True, "format_version"),
    (("format_version",), None, "format_version"),
    (("kind",), DELETE, "kind"),
    (("format_version",), DELETE, "format_version"),
    (("config",), DELETE, "config"),
    (("values",), DELETE, "values"),
    (("config", "hysteresis"), DELETE, "config.hysteresis"),
    (("config", "min_scale"), DELETE, "config.min_scale"),
    (("values", "nonfinite_tracker"), DELETE, "values.nonfinite_tracker"),
    (("extra",), 1, "extra"),
    (("config", "init_scale"), 1024.0, "config.init_scale"),   # a plausible mistake
    (("values", "step"), 10, "values.step"),
    (("config",), [], "config"),
    (("config",), None, "config"),
    (("values",), "{}", "values"),
    (("values",), {}, "values.loss_scale"),
]


@pytest.mark.parametrize(
    ("path", "value", "field"), CORRUPTED,
    ids=[f"{'.'.join(p)}={short(v)}" for p, v, _ in CORRUPTED])
def test_corrupted_dict_is_refused_naming_the_field(path, value, field):
    with pytest.raises(ValueError) as info:
        from_state_dict(corrupt(path, value))
    message = str(info.value)
    assert message.startswith(INVALID), message
    assert field in message, message


@pytest.mark.parametrize(
    ("d", "field"),
    [
        ([], "dict"),
        (None, "dict"),
        ("dynamic", "dict"),
        (json.dumps(base_dict()), "dict"),             # a JSON string, not loaded
        ({}, "format_version"),
        ({1: 2, **base_dict()}, "1"),
        ({"format_version": 1, "kind": "static", "config": {},
          "values": {"loss_scale": NAN}}, "values.loss_scale"),
        ({"format_version": 1, "kind": "static", "config": {"x": 1},
          "values": {"loss_scale": 1.0}}, "config.x"),
        ({"format_version": 1, "kind": "noop", "config": {},
          "values": {"loss_scale": 1.0}}, "values.loss_scale"),
        ({"format_version": 1, "kind": "noop", "config": None, "values": {}}, "config"),
    ],
    ids=repr,
)
def test_malformed_dict_is_refused_naming_the_field(d, field):
    with pytest.raises(ValueError) as info:
        from_state_dict(d)
    assert str(info.value).startswith(INVALID)
    assert field in str(info.value)


def test_huge_and_deep_values_still_give_a_readable_value_error():
    deep: list = []
    for _ in range(50_000):
        deep = [deep]
    for d in [corrupt(("kind",), deep), corrupt(("values", "loss_scale"), 10**5000),
              corrupt(("extra",), deep), corrupt(("values", "loss_scale"), -(10**5000))]:
        with pytest.raises(ValueError, match=INVALID):
            from_state_dict(d)


# -------------------------------------------------------------- corrupted, randomized

f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def valid_dicts(draw) -> dict:
    """Any valid state dict (independent of the implementation under test)."""
    kind = draw(st.sampled_from(["noop", "static", "dynamic"]))
    d = {"format_version": 1, "kind": kind, "config": {}, "values": {}}
    if kind == "noop":
        return d
    scale = draw(st.floats(min_value=TINY, max_value=F32_MAX, width=32))
    d["values"]["loss_scale"] = scale
    if kind == "static":
        return d
    interval = draw(st.integers(1, 2**31 - 1))
    hysteresis = draw(st.integers(1, 2**31 - 1))
    d["config"] = {
        "growth_factor": draw(st.floats(min_value=1.0, max_value=2.0**100, exclude_min=True,
                                        width=32)),
        "backoff_factor": draw(st.floats(min_value=TINY, max_value=1.0, exclude_max=True,
                                         width=32)),   # subnormal factors are refused
        "growth_interval": interval,
        "hysteresis": hysteresis,
        "min_scale": draw(st.none() | st.floats(min_value=TINY, max_value=scale, width=32)),
        "max_scale": draw(st.none() | st.floats(min_value=scale, max_value=F32_MAX,
                                                width=32)),
    }
    d["values"]["growth_tracker"] = draw(st.integers(0, interval - 1))
    d["values"]["nonfinite_tracker"] = draw(st.integers(0, hysteresis))
    return d


@settings(max_examples=150, deadline=None)
@given(valid_dicts())
def test_every_valid_dict_round_trips_through_json(d):
    s = from_state_dict(json_round_trip(d))
    assert state_dict(s) == d
    assert s.loss_scale.dtype == jnp.float32
    if d["kind"] != "noop":
        assert np.float32(s.loss_scale).tobytes() == np.float32(
            d["values"]["loss_scale"]).tobytes()


json_scalars = (st.none() | st.booleans() | st.integers() | st.text(max_size=8)
                | st.floats())
junk = st.recursive(
    json_scalars,
    lambda children: (st.lists(children, max_size=3)
                      | st.dictionaries(st.text(max_size=5), children, max_size=3)
                      | st.tuples(children)),
    max_leaves=8,
)
hostile_keys = st.text(max_size=10) | st.integers() | st.none() | st.booleans()
huge_ints = st.integers(min_value=2**63) | st.integers(max_value=-(2**63)) | st.just(10**5000)
not_numbers = (junk.filter(lambda v: isinstance(v, bool) or not isinstance(v, (int, float)))
               | st.binary(max_size=4) | st.just(object()))
# Floats that are certainly not positive normal float32 values.
bad_scales = (
    st.sampled_from([NAN, INF, -INF, 0.0, -0.0])
    | st.floats(max_value=0.0) | st.integers(max_value=0)
    | st.floats(min_value=0.0, max_value=0.99 * TINY)          # subnormal or 0 as float32
    | st.floats(min_value=3.5e38, allow_infinity=False) | st.integers(min_value=4 * 10**38)
)
not_integers = not_numbers | st.floats()                       # 1.0 is a wrong type too


def bad_value(draw, kind: str, level: str, key: str, d: dict):
    """A value that makes ``d[level][key]`` certainly invalid."""
    values, config = d["values"], d["config"]
    if key == "loss_scale":
        options = [not_numbers, bad_scales]
        if config.get("min_scale") is not None and config["min_scale"] > TINY:
            options.append(st.floats(min_value=TINY, max_value=config["min_scale"],
                                     exclude_max=True, width=32))
        if config.get("max_scale") is not None and config["max_scale"] < F32_MAX:
            options.append(st.floats(min_value=config["max_scale"], max_value=F32_MAX,
                                     exclude_min=True, width=32))
    elif key in ("min_scale", "max_scale"):
        scale = values["loss_scale"]
        options = [not_numbers.filter(lambda v: v is not None), bad_scales]
        if key == "min_scale" and scale < F32_MAX:
            options.append(st.floats(min_value=scale, max_value=F32_MAX, exclude_min=True,
                                     width=32))
        if key == "max_scale" and scale > TINY:
            options.append(st.floats(min_value=TINY, max_value=scale, exclude_max=True,
                                     width=32))
    elif key == "growth_factor":
        options = [not_numbers, st.sampled_from([NAN, INF, -INF]),
                   st.floats(max_value=1.0), st.integers(max_value=1),
                   st.floats(min_value=3.5e38), st.integers(min_value=4 * 10**38),
                   st.just(10**5000)]
    elif key == "backoff_factor":
        options = [not_numbers, st.sampled_from([NAN, INF, -INF]),
                   st.floats(max_value=0.0), st.floats(min_value=1.0),
                   st.floats(min_value=0.0, max_value=7e-46),   # 0.0 as float32
                   st.integers(max_value=0), st.integers(min_value=1), huge_ints]
    elif key in ("growth_interval", "hysteresis"):
        options = [not_integers, st.integers(max_value=0), st.integers(min_value=2**31),
                   huge_ints]
    elif key == "growth_tracker":
        options = [not_integers, st.integers(max_value=-1),
                   st.integers(min_value=config["growth_interval"]), huge_ints]
    elif key == "nonfinite_tracker":
        options = [not_integers, st.integers(max_value=-1),
                   st.integers(min_value=config["hysteresis"] + 1), huge_ints]
    elif key == "format_version":
        options = [junk.filter(lambda v: not (type(v) is int and v == 1)), huge_ints]
    elif key == "kind":
        options = [st.sampled_from(["noop", "static", "dynamic"]).filter(lambda k: k != kind),
                   junk.filter(lambda v: v not in ("noop", "static", "dynamic")),
                   st.sampled_from(["Dynamic", "DYNAMIC", " dynamic", "none", ""])]
    else:  # "config" or "values" as a whole
        options = [junk.filter(lambda v: not isinstance(v, dict)),
                   st.dictionaries(st.text(max_size=5), junk, max_size=3).map(
                       lambda extra: {**extra, "not a field": 0})]
        if d[key]:
            options.append(st.just({}))
    return draw(st.one_of(options))


@st.composite
def invalid_dicts(draw):
    """A valid dict with one mutation that no valid dict can have (or not a dict at all)."""
    d = copy.deepcopy(draw(valid_dicts()))
    kind = d["kind"]
    mutation = draw(st.sampled_from(["not_a_dict", "delete", "add", "replace"]))
    if mutation == "not_a_dict":
        return draw(junk.filter(lambda v: not isinstance(v, dict))
                    | st.binary() | st.just(object()) | st.just(list(d.items())))
    levels = [("top", d)] + [(name, d[name]) for name in ("config", "values") if d[name]]
    level, node = draw(st.sampled_from(levels))
    if mutation == "delete":
        del node[draw(st.sampled_from(sorted(node)))]
    elif mutation == "add":
        level, node = draw(st.sampled_from([("top", d), ("config", d["config"]),
                                            ("values", d["values"])]))
        key = draw(hostile_keys.filter(lambda k: k not in node))
        node[key] = draw(junk | huge_ints)
    else:
        key = draw(st.sampled_from(sorted(node)))
        node[key] = bad_value(draw, kind, level, key, d)
    return d


@settings(max_examples=400, deadline=None)
@given(invalid_dicts())
def test_hostile_dicts_are_refused_with_value_error_only(d):
    with pytest.raises(ValueError) as info:   # any other exception fails the test
        from_state_dict(d)
    assert str(info.value).startswith(INVALID), info.value


# ------------------------------------------------------------------- config changes


def saved_state() -> ls.DynamicLossScale:
    """growth_interval 5 with growth_tracker 3; hysteresis 3 (values from the config)."""
    return dynamic_after_clean_steps()


def target(**changes) -> ls.DynamicLossScale:
    return ls.DynamicLossScale(init_scale=1.0 if "min_scale" not in changes else
                               changes["min_scale"], **{**CUSTOM_CONFIG, **changes})


@pytest.mark.parametrize("as_dict", [False, True], ids=["scaler", "dict"])
def test_check_same_config_accepts_the_same_configuration(as_dict):
    saved = saved_state()
    check_same_config(state_dict(saved) if as_dict else saved, target())
    check_same_config(ls.StaticLossScale(8.0), ls.StaticLossScale(8.0))
    check_same_config(ls.NoOpLossScale(), ls.NoOpLossScale())


@pytest.mark.parametrize("as_dict", [False, True], ids=["scaler", "dict"])
def test_a_static_factor_is_configuration_refused_unless_adopted(as_dict):
    saved = ls.StaticLossScale(128.0)
    saved = state_dict(saved) if as_dict else saved
    with pytest.raises(ValueError, match=r"loss_scale \(a StaticLossScale's factor\): saved "
                                         r"128.0, target 1024.0"):
        check_same_config(saved, ls.StaticLossScale(1024.0))
    # Adopting the configuration: the target's factor; an abstract target has none.
    assert float(restore_with_config(saved, ls.StaticLossScale(1024.0)).loss_scale) == 1024.0
    abstract = jax.eval_shape(lambda: ls.StaticLossScale(1024.0))
    check_same_config(saved, abstract)
    assert float(restore_with_config(saved, abstract).loss_scale) == 128.0


@pytest.mark.parametrize("as_dict", [False, True], ids=["scaler", "dict"])
def test_check_same_config_lists_every_difference(as_dict):
    saved = saved_state()
    new = target(growth_interval=100, hysteresis=1, max_scale=None)
    with pytest.raises(ValueError) as info:
        check_same_config(state_dict(saved) if as_dict else saved, new)
    message = str(info.value)
    assert "growth_interval: saved 5, target 100" in message
    assert "hysteresis: saved 3, target 1" in message
    assert f"max_scale: saved {2.0**20 + 1.0!r}, target None" in message
    for same in ("growth_factor", "backoff_factor", "min_scale"):
        assert f"{same}:" not in message
    assert "restore_with_config" in message


def test_check_same_config_refuses_another_kind_and_bad_input():
    with pytest.raises(ValueError, match="kind: saved 'dynamic', target 'static'"):
        check_same_config(saved_state(), ls.StaticLossScale(2.0))
    with pytest.raises(ValueError, match=INVALID):
        check_same_config(corrupt(("values", "loss_scale"), NAN), target())
    with pytest.raises(TypeError):
        check_same_config(saved_state(), {"growth_interval": 5})


@MAYBE_JIT
@pytest.mark.parametrize("as_dict", [False, True], ids=["scaler", "dict"])
def test_restore_with_config_keeps_saved_values_under_new_config(as_dict, maybe_jit):
    saved = saved_state()
    new = target(growth_interval=4, hysteresis=1, min_scale=0.5, max_scale=None)
    s = restore_with_config(state_dict(saved) if as_dict else saved, new)
    assert config_of(s) == config_of(new)
    assert s.loss_scale.dtype == jnp.float32 and s.growth_tracker.dtype == jnp.int32
    assert np.float32(s.loss_scale).tobytes() == np.float32(saved.loss_scale).tobytes()
    assert int(s.growth_tracker) == 3 and int(s.nonfinite_tracker) == 0
    grown = maybe_jit(ls.update)(s, True)   # the 4th clean step grows under the new config
    assert float(grown.loss_scale) == float(
        np.float32(saved.loss_scale) * np.float32(CUSTOM_CONFIG["growth_factor"]))
    assert int(grown.growth_tracker) == 0


def test_restore_with_config_clamps_the_trackers():
    saved = dynamic_both_trackers()                   # trackers (4, 3)
    s = restore_with_config(saved, target(growth_interval=2, hysteresis=2))
    assert (int(s.growth_tracker), int(s.nonfinite_tracker)) == (1, 2)
    s = restore_with_config(saved, target(growth_interval=1000, hysteresis=10))
    assert (int(s.growth_tracker), int(s.nonfinite_tracker)) == (4, 3)
    assert state_dict(s)["config"]["growth_interval"] == 1000


def test_restore_with_config_with_the_same_config_is_the_saved_state():
    saved = dynamic_after_overflows()
    assert_bit_identical(restore_with_config(saved, target()), saved)
    assert_bit_identical(restore_with_config(ls.StaticLossScale(64.0), ls.StaticLossScale(64.0)),
                         ls.StaticLossScale(64.0))
    assert_bit_identical(restore_with_config(ls.NoOpLossScale(), ls.NoOpLossScale()),
                         ls.NoOpLossScale())


def test_restore_with_config_refuses_a_scale_outside_the_new_bounds():
    saved = saved_state()                              # scale ~330
    with pytest.raises(ValueError, match="min_scale"):
        restore_with_config(saved, target(min_scale=512.0))
    with pytest.raises(ValueError, match="max_scale"):
        restore_with_config(saved, target(max_scale=256.0))


def test_restore_with_config_refuses_other_kinds_and_invalid_saved_state():
    with pytest.raises(ValueError, match="kind"):
        restore_with_config(saved_state(), ls.StaticLossScale(2.0))
    with pytest.raises(ValueError, match="kind"):
        restore_with_config(state_dict(ls.NoOpLossScale()), target())
    with pytest.raises(ValueError, match="values.growth_tracker"):
        restore_with_config(corrupt(("values", "growth_tracker"), 5), target(growth_interval=9))
    with pytest.raises(TypeError):
        restore_with_config(saved_state(), None)


# ------------------------------------------------------------------ flax.serialization


def test_flax_state_dict_is_a_checked_record_and_names_the_leaves_of_placeholders():
    s = saved_state()
    assert flax.serialization.to_state_dict(ls.NoOpLossScale()) == {}
    record = flax.serialization.to_state_dict({"scaler": s})["scaler"]
    # magic, kind, ndim 0, four 4-byte leaves, CRC-32: 26 bytes, one msgpack bin.
    assert isinstance(record, bytes) and record[:4] == b"LSR1" and len(record) == 26
    assert record[6:10] == np.float32(s.loss_scale).tobytes()
    assert len(flax.serialization.to_state_dict(ls.StaticLossScale(2.0))) == 14
    # Placeholders have no values to check: their leaves by name, as before.
    abstract = flax.serialization.to_state_dict(jax.eval_shape(lambda: s))
    assert set(abstract) == {"loss_scale", "growth_tracker", "nonfinite_tracker", "failure"}
    assert abstract["growth_tracker"] == jax.ShapeDtypeStruct((), jnp.int32)


@ALL_STATES
def test_flax_msgpack_round_trip_inside_a_dict(make):
    s = make()
    tree = {"scaler": s, "step": jnp.int32(7)}
    encoded = flax.serialization.msgpack_serialize(flax.serialization.to_state_dict(tree))
    # A static factor is configuration: the target must have the saved one.
    fresh_scaler = s if isinstance(s, ls.StaticLossScale) else jax.tree.map(jnp.zeros_like, s)
    fresh = {"scaler": fresh_scaler, "step": jnp.int32(0)}
    restored = flax.serialization.from_state_dict(
        fresh, flax.serialization.msgpack_restore(encoded))
    assert_bit_identical(restored["scaler"], s)
    assert_bit_identical(flax.serialization.from_bytes(fresh, flax.serialization.to_bytes(tree)),
                         jax.tree.map(jnp.asarray, tree))
    assert_bit_identical(jax.jit(ls.update)(restored["scaler"], False), ls.update(s, False))


def test_flax_restore_keeps_the_target_configuration():
    saved = saved_state()
    new = target(growth_interval=50, max_scale=None)
    restored = flax.serialization.from_bytes(new, flax.serialization.to_bytes(saved))
    assert config_of(restored) == config_of(new)
    assert float(restored.loss_scale) == float(saved.loss_scale)
    assert int(restored.growth_tracker) == 3


@pytest.mark.parametrize(
    ("state", "text"),
    [
        ({"loss_scale": np.float32(NAN), "growth_tracker": 0, "nonfinite_tracker": 0,
          "failure": 0},
         "loss_scale"),
        ({"loss_scale": np.float32(1e-39), "growth_tracker": 0, "nonfinite_tracker": 0,
          "failure": 0},
         "loss_scale"),
        ({"loss_scale": np.float32(0.01), "growth_tracker": 0, "nonfinite_tracker": 0,
          "failure": 0},
         "loss_scale"),                                            # below min_scale 0.1
        ({"loss_scale": np.float32(8.0), "growth_tracker": 5, "nonfinite_tracker": 0,
          "failure": 0},
         "restore_with_config"),                                   # not below growth_interval
        ({"loss_scale": np.float32(8.0), "growth_tracker": 0, "nonfinite_tracker": -1,
          "failure": 0},
         "nonfinite_tracker"),
        ({"loss_scale": np.int32(8), "growth_tracker": 0, "nonfinite_tracker": 0,
          "failure": 0},
         "floating"),
        ({"loss_scale": "8", "growth_tracker": 0, "nonfinite_tracker": 0,
          "failure": 0}, "loss_scale"),
        ({"loss_scale": np.float32(8.0), "growth_tracker": 0.5, "nonfinite_tracker": 0,
          "failure": 0},
         "integer"),
        ({"loss_scale": np.float32(8.0), "growth_tracker": 0}, "nonfinite_tracker"),
        ({"loss_scale": 8.0, "growth_tracker": 0, "nonfinite_tracker": 0, "x": 1}, "'x'"),
        ([8.0, 0, 0], "loss_scale"),
    ],
    ids=repr,
)
def test_flax_restore_refuses_bad_state_with_its_path(state, text):
    with pytest.raises(ValueError) as info:
        flax.serialization.from_state_dict({"opt": {"scaler": saved_state()}},
                                           {"opt": {"scaler": state}})
    assert "'./opt/scaler'" in str(info.value)
    assert text in str(info.value)


def test_flax_restore_into_placeholder_targets():
    s = saved_state()
    state = flax.serialization.to_state_dict(s)
    for placeholder in (jax.tree.map(lambda _: None, s), jax.eval_shape(lambda: s)):
        assert_bit_identical(flax.serialization.from_state_dict(placeholder, state), s)


def test_flax_round_trip_of_a_wrapped_optax_state():
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    tx = ls.with_loss_scaling(optax.adam(0.1), ls.DynamicLossScale(
        init_scale=2.0**10, growth_interval=2, hysteresis=2))
    opt_state = tx.init(params)
    for grads in ([1.0, 2.0, 3.0], [NAN, 0.0, 1.0], [INF, 0.0, 0.0], [0.5, 0.5, 0.5]):
        updates, opt_state = tx.update({"w": jnp.array(grads)}, opt_state, params)
        params = optax.apply_updates(params, updates)
    encoded = flax.serialization.to_bytes((params, opt_state))
    restored = flax.serialization.from_bytes((params, tx.init(params)), encoded)
    chex.assert_trees_all_equal(restored, (params, opt_state))
    chex.assert_trees_all_equal_dtypes(restored, (params, opt_state))
    assert_bit_identical(ls.get_loss_scale(restored[1]), ls.get_loss_scale(opt_state))
    assert not math.isnan(float(ls.get_loss_scale(restored[1]).loss_scale))


# ------------------------------------------------------- validation leniencies (issue 13)

NON_NUMBERS = [np.array(5, "datetime64[ns]"), np.array(5, "timedelta64[ns]"),
               np.array(5.0, dtype=object), np.timedelta64(5, "ns"), np.datetime64(5, "ns"),
               np.array(b"5")]


@pytest.mark.parametrize("value", NON_NUMBERS, ids=lambda v: f"{type(v).__name__}:{v.dtype}")
def test_non_numeric_0d_arrays_are_refused_everywhere(value):
    for build, name in [(lambda v: ls.StaticLossScale(v), "loss_scale"),
                        (lambda v: ls.DynamicLossScale(init_scale=v), "init_scale"),
                        (lambda v: ls.DynamicLossScale(growth_factor=v), "growth_factor"),
                        (lambda v: ls.DynamicLossScale(backoff_factor=v), "backoff_factor")]:
        with pytest.raises(ValueError, match=name):
            build(value)
    for path in [("values", "loss_scale"), ("values", "growth_tracker"),
                 ("config", "growth_factor"), ("config", "growth_interval")]:
        d = state_dict(ls.DynamicLossScale(init_scale=4.0))
        d[path[0]][path[1]] = value
        with pytest.raises(ValueError, match=".".join(path)):
            from_state_dict(d)


def test_numeric_0d_arrays_are_still_numbers():
    for value in (np.array(4.0), np.float16(4.0), jnp.bfloat16(4.0), jnp.asarray(4),
                  np.int64(4)):
        assert float(ls.StaticLossScale(value).loss_scale) == 4.0
        d = state_dict(ls.StaticLossScale(2.0))
        d["values"]["loss_scale"] = value
        assert float(from_state_dict(d).loss_scale) == 4.0


@pytest.mark.parametrize("factor", [1e-45, TINY / 2, float(np.nextafter(np.float32(TINY), 0))])
def test_a_subnormal_backoff_factor_is_refused(factor):
    # Accepted before, and the first overflow then failed the run: XLA on CPU reads a
    # subnormal operand as 0, so every backoff gave a zero scale.
    with pytest.raises(ValueError, match="backoff_factor must be a normal float32"):
        ls.DynamicLossScale(backoff_factor=factor)
    d = state_dict(ls.DynamicLossScale())
    d["config"]["backoff_factor"] = factor
    with pytest.raises(ValueError, match="config.backoff_factor must be a normal float32"):
        from_state_dict(d)


@MAYBE_JIT
def test_the_smallest_normal_backoff_factor_backs_off(maybe_jit):
    s = ls.DynamicLossScale(init_scale=F32_MAX, backoff_factor=TINY)
    backed_off = maybe_jit(ls.update)(s, False)
    assert int(backed_off.failure) == 0
    assert float(backed_off.loss_scale) == float(np.float32(F32_MAX) * np.float32(TINY))


# ----------------------------------------------- flax.serialization: layout and record

def flax_restore(target, state):
    return flax.serialization.from_state_dict({"opt": {"scaler": target}},
                                              {"opt": {"scaler": state}})["opt"]["scaler"]


@pytest.mark.parametrize("bad", [
    np.zeros((0,), np.float32), np.full((2, 2), 8.0, np.float32), [8.0], [[8.0]],
    np.full((1,), 8.0, np.float32)], ids=["empty", "2d", "list", "nested_list", "replicated"])
def test_flax_restore_checks_shapes_against_the_target(bad):
    state = {"loss_scale": bad, "growth_tracker": np.int32(0), "nonfinite_tracker": np.int32(0),
             "failure": np.int32(0)}
    with pytest.raises(ValueError, match=r"'./opt/scaler'.*loss_scale has shape"):
        flax_restore(saved_state(), state)
    with pytest.raises(ValueError, match=r"loss_scale has shape"):
        flax_restore(ls.StaticLossScale(8.0), {"loss_scale": bad})


def test_flax_bytes_of_a_replicated_state_restore_only_into_a_replicated_target():
    s = saved_state()
    replicated = jax.tree.map(lambda x: jnp.stack([x] * 2), s)
    data = flax.serialization.to_bytes(replicated)
    with pytest.raises(ValueError, match=r"loss_scale has shape \(2,\), the target's has "
                                         r"shape \(\): .*replicate"):
        flax.serialization.from_bytes(s, data)
    restored = flax.serialization.from_bytes(jax.tree.map(jnp.zeros_like, replicated), data)
    assert_bit_identical(restored, replicated)
    # ...and the other way round: unreplicated bytes into a replicated target.
    with pytest.raises(ValueError, match=r"shape \(\), the target's has shape \(2,\)"):
        flax.serialization.from_bytes(replicated, flax.serialization.to_bytes(s))


@MAYBE_JIT
def test_a_restored_scalar_state_keeps_scalar_params_scalar(maybe_jit):
    # The symptom: a (1,) scale from replicated bytes turned scalar params into (1,).
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(init_scale=8.0))
    params = jnp.float32(1.0)
    opt_state = tx.init(params)
    data = flax.serialization.to_bytes(opt_state)
    restored = flax.serialization.from_bytes(tx.init(params), data)
    updates, _ = maybe_jit(tx.update)(jnp.float32(8.0), restored, params)
    assert optax.apply_updates(params, updates).shape == ()


def test_flax_restore_refuses_a_different_static_factor_and_accepts_a_placeholder():
    data = flax.serialization.to_bytes({"scaler": ls.StaticLossScale(128.0)})
    with pytest.raises(ValueError, match=r"'./scaler'.*loss_scale: saved \[?128.0\]?, the "
                                         r"target's StaticLossScale factor is \[?1024.0"):
        flax.serialization.from_bytes({"scaler": ls.StaticLossScale(1024.0)}, data)
    same = flax.serialization.from_bytes({"scaler": ls.StaticLossScale(128.0)}, data)
    assert float(same["scaler"].loss_scale) == 128.0
    placeholder = jax.tree.map(lambda _: None, {"scaler": ls.StaticLossScale(1024.0)})
    assert float(flax.serialization.from_bytes(placeholder, data)["scaler"].loss_scale) == 128.0


def test_flax_bytes_from_before_the_record_and_the_failure_leaf_are_refused():
    """Pre-release bytes (named leaves without ``failure``, before the CRC record) are no
    longer completed: 0.1.0 was never released without the record."""
    s = saved_state()
    old_dict = {"loss_scale": np.asarray(s.loss_scale), "growth_tracker": np.int32(3),
                "nonfinite_tracker": np.int32(0)}          # no `failure`, no record
    old_bytes = flax.serialization.msgpack_serialize({"scaler": old_dict})
    with pytest.raises(ValueError, match="checked record of the keys"):
        flax.serialization.from_bytes({"scaler": target()}, old_bytes)
    restored = flax.serialization.from_bytes({"scaler": target()},
                                             flax.serialization.to_bytes({"scaler": s}))
    assert_bit_identical(restored["scaler"], s)


def flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def test_a_bit_flip_in_the_scale_that_stays_in_range_is_refused():
    s = saved_state()
    data = flax.serialization.to_bytes(s)
    offset = data.index(np.float32(s.loss_scale).tobytes())
    for bit in range(23):              # every mantissa bit: another valid, in-range scale
        with pytest.raises(ValueError, match=r"'\.'.*fails its CRC-32 check"):
            flax.serialization.from_bytes(target(), flip(data, 8 * offset + bit))


@pytest.mark.parametrize("make", [dynamic_after_overflows, STATES["static"]],
                         ids=["dynamic", "static"])
def test_every_single_bit_flip_and_truncation_of_to_bytes_is_refused(make):
    s = make()
    fresh = s if isinstance(s, ls.StaticLossScale) else target()
    data = flax.serialization.to_bytes(s)
    corrupted = [flip(data, bit) for bit in range(8 * len(data))]
    corrupted += [data[:n] for n in range(len(data))]
    named = 0
    for bad in corrupted:
        with pytest.raises(ValueError, match="loss-scale state") as info:
            ls.from_bytes(fresh, bad)
        # flax's own from_bytes: a ValueError too; it names the field unless msgpack itself
        # failed on the record's 2-byte header or on a truncation.
        with pytest.raises(ValueError) as flax_info:
            flax.serialization.from_bytes(fresh, bad)
        named += "loss-scale state" in str(flax_info.value)
        assert "cannot" in str(info.value)
    assert named >= 8 * (len(data) - 2) - 16   # all but the header's bits and truncations


def test_from_bytes_turns_decoding_errors_outside_the_loss_scale_into_value_errors():
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(init_scale=8.0))
    tree = {"params": np.arange(3.0, dtype=np.float32), "opt": tx.init(jnp.zeros(3))}
    data = flax.serialization.to_bytes(tree)
    # A dtype name of the params array made undecodable: flax raises TypeError there.
    name = data.index(b"float32")
    bad = data[:name] + b"\xffloat32" + data[name + 7:]
    with pytest.raises(Exception) as info:
        flax.serialization.from_bytes(tree, bad)
    assert not isinstance(info.value, ValueError) or "loss-scale" not in str(info.value)
    with pytest.raises(ValueError, match=r"loss-scale state at './opt/scaler'"):
        ls.from_bytes(tree, bad)


def test_restore_with_config_keeps_a_failure_and_the_targets_layout():
    failed = jax.jit(ls.update)(ls.DynamicLossScale(init_scale=TINY), False)
    assert int(failed.failure) != 0
    adopted = restore_with_config(failed, ls.DynamicLossScale(init_scale=1.0, min_scale=TINY))
    assert int(adopted.failure) == int(failed.failure)    # never healed silently
    with pytest.raises(ls.LossScaleError):
        ls.check(adopted)
    replicated = jax.tree.map(lambda x: jnp.stack([x, x]), target())
    s = restore_with_config(saved_state(), replicated)
    assert all(leaf.shape == (2,) for leaf in jax.tree.leaves(s))
    assert s.loss_scale.tolist() == [float(saved_state().loss_scale)] * 2
    static = restore_with_config(ls.StaticLossScale(8.0), jax.tree.map(
        lambda x: jnp.stack([x, x]), ls.StaticLossScale(4.0)))
    assert static.loss_scale.tolist() == [4.0, 4.0]


leaf_junk = (junk | st.binary(max_size=40)
             | st.builds(np.asarray, st.lists(st.floats(width=32), max_size=3))
             | st.sampled_from([np.array(5, "datetime64[ns]"), np.array(1.0, dtype=object),
                                np.zeros((0,), np.int32), np.float16(2.0), np.int8(1)]))


@settings(max_examples=150, deadline=None)
@given(state=leaf_junk | st.fixed_dictionaries(
    {"loss_scale": leaf_junk, "growth_tracker": leaf_junk, "nonfinite_tracker": leaf_junk},
    optional={"failure": leaf_junk}))
def test_flax_restore_of_hostile_state_is_a_valid_state_or_a_value_error(state):
    try:
        restored = flax_restore(saved_state(), state)
    except ValueError as error:
        assert "'./opt/scaler'" in str(error)
        return
    # Accepted: scalars of the right dtypes, valid for the target's configuration.
    assert isinstance(restored, ls.DynamicLossScale)
    for leaf, dtype in zip(jax.tree.leaves(restored), (jnp.float32,) + (jnp.int32,) * 3,
                           strict=True):
        assert leaf.shape == () and leaf.dtype == dtype
    ls.from_state_dict(state_dict(restored))   # it is a valid state


# ------------------------------------------------ hand-written floats must be float32


@pytest.mark.parametrize(("level", "key", "value", "below", "above"), [
    ("values", "loss_scale", 16777217.0, 16777216.0, 16777218.0),
    ("values", "loss_scale", 16777217, 16777216.0, 16777218.0),   # an int, too
    ("config", "growth_factor", 1.1, 1.0999999046325684, 1.100000023841858),
    ("config", "backoff_factor", 0.3, 0.29999998211860657, 0.30000001192092896),
    ("config", "min_scale", 0.1, 0.09999999403953552, 0.10000000149011612),
    ("config", "max_scale", 2.0**40 + 1, 2.0**40, 1099511758848.0),
])
def test_a_value_float32_does_not_hold_exactly_is_refused_naming_its_neighbours(
        level, key, value, below, above):
    d = state_dict(ls.DynamicLossScale(init_scale=1.0))
    d[level][key] = value
    with pytest.raises(ValueError, match=re.escape(
            f"{level}.{key} is {float(value)!r}, which float32 does not represent exactly: "
            f"the nearest float32 values are {below!r} and {above!r}")):
        from_state_dict(d)
    d[level][key] = below   # the float32 value itself is exact
    assert from_state_dict(d) is not None
