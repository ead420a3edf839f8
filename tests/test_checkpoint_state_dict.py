"""The JSON format (loss_scaling/checkpoint/state_dict.py): ``ls.state_dict`` and
``ls.from_state_dict``, round trips bit for bit, and every untrusted dict refused naming
its field.

The hostile-input test generates only dicts that are certainly invalid (each is a valid dict
with one mutation that no valid dict can have), so the expectation is always a ValueError.
"""

from __future__ import annotations

import copy
import json
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_states import (
    ALL_STATES,
    CUSTOM_CONFIG,
    DELETE,
    F32_MAX,
    INF,
    INVALID,
    MAYBE_JIT,
    NAN,
    TINY,
    assert_bit_identical,
    base_dict,
    corrupt,
    dynamic_after_clean_steps,
    dynamic_after_overflows,
    junk,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import loss_scaling as ls
from loss_scaling import from_state_dict, state_dict


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


def short(value) -> str:
    if value is DELETE:
        return "DELETE"
    if isinstance(value, int) and value.bit_length() > 64:
        return f"int{value.bit_length()}"
    return repr(value)[:30]


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
