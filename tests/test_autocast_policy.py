"""Forward overflows no loss scale can fix: ``ls.autocast_report`` measures them and
``report.policy`` keeps exactly those equations in float32 (overflow_zoo.py plants three in
float32 language models; a fourth model is healthy)."""

from __future__ import annotations

import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from autocast_zoo import train_in_one_scan
from jaxpr_walk import equations, flops_by_dtype, half_fraction
from overflow_zoo import PLANTED, planted, tokens

import loss_scaling as ls
from loss_scaling.autocast.policy import Site
from loss_scaling.autocast.rewrite import HEADROOM_FACTOR

PLANTED_AT = {"massive": "LM/block_0/wo", "t5_wo": "LM/block_1/wo",
              "qk": "LM/block_0/bqhd,bkhd->bhqk"}


@functools.cache
def _report(name: str) -> Any:
    """The model and its report, measured once for the whole file (an eager run)."""
    m = planted(name)
    return m, ls.autocast_report(m.loss(), m.params, tokens(0))


def _with(policy: Any) -> Any:
    return lambda fn: ls.autocast(fn, policy=policy)


@pytest.mark.parametrize("name", PLANTED)
def test_the_report_flags_the_planted_overflow_and_nothing_else(name: str) -> None:
    m, report = _report(name)
    assert not np.isfinite(float(m.loss(ls.autocast)(m.params, tokens(0))))
    (row,) = report.overflows
    assert (row.path, row.primitive, row.overflows) == (PLANTED_AT[name], "dot_general",
                                                        "result")
    assert row.max_abs == np.inf and report.measured and report.unfixed == ()
    text = str(report)  # the fix and the overflow first, then the whole table
    assert text.index("ls.autocast(fn, policy=report.policy)") < text.index(PLANTED_AT[name]) \
        < text.rindex("\nprimitive ")
    assert report.policy.float32 == ()
    (site,) = report.policy.float32_out
    assert site.path == PLANTED_AT[name] and site.primitive == "dot_general"
    assert site.source.startswith("tests/overflow_zoo.py:")  # relative: holds elsewhere


@pytest.mark.parametrize("name", PLANTED)
def test_under_the_policy_the_loss_and_gradients_are_finite_and_half_flops_stay(
        name: str) -> None:
    m, report = _report(name)
    loss_fn = m.loss(_with(report.policy))
    value_and_grad, float32_loss = jax.jit(jax.value_and_grad(loss_fn)), jax.jit(m.loss())
    for step in range(3):  # batches the report never saw too
        batch = tokens(step)
        loss, grads = value_and_grad(m.params, batch)
        assert np.isfinite(float(loss))
        assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
        reference = float(float32_loss(m.params, batch))
        assert abs(float(loss) - reference) <= 0.03 * reference
    program = jax.make_jaxpr(jax.value_and_grad(loss_fn))(m.params, tokens(0))
    assert half_fraction(program) >= 0.85, flops_by_dtype(program)


def _train(loss_fn: Any, params: Any, steps: int, scaled: bool) -> Any:
    batches = jax.tree.map(lambda *xs: jnp.stack(xs), *[tokens(s) for s in range(1, steps + 1)])
    tx = ls.with_loss_scaling(optax.adam(1e-3)) if scaled else optax.adam(1e-3)
    return train_in_one_scan(loss_fn, params, batches, tx, scaled)


@pytest.mark.parametrize("name", PLANTED)
def test_100_loss_scaled_steps_under_the_policy_track_float32(name: str) -> None:
    m, report = _report(name)
    losses32, _ = _train(m.loss(), m.params, 100, scaled=False)
    losses16, opt_state = _train(m.loss(_with(report.policy)), m.params, 100, scaled=True)
    ls.check(opt_state)
    assert np.isfinite(losses16).all()
    assert int(ls.metrics(opt_state)["skipped_steps"]) <= 10
    smooth = lambda x: np.convolve(x, np.ones(10) / 10, mode="valid")  # noqa: E731
    start = losses32[0]
    assert losses32[-10:].mean() < 0.9 * start
    assert np.abs(smooth(losses16) - smooth(losses32)).max() <= 0.1 * start
    assert abs(losses16[-10:].mean() - losses32[-10:].mean()) <= 0.03 * start


def test_a_healthy_model_gets_the_default_policy_and_the_same_program() -> None:
    m, report = _report("healthy")
    assert report.measured and report.overflows == () and report.unfixed == ()
    assert report.policy == ls.AutocastPolicy() and report.policy.is_default
    assert "every half result fits float16" in str(report)
    batch = tokens(0)
    default = jax.jit(jax.value_and_grad(m.loss(ls.autocast))).lower(m.params, batch)
    policed = jax.jit(jax.value_and_grad(m.loss(_with(report.policy)))).lower(m.params, batch)
    assert policed.as_text() == default.as_text()


def test_a_result_near_the_half_maximum_is_flagged_before_it_overflows() -> None:
    w = jnp.full((4, 3), 100.0, jnp.float32)
    near = jnp.full((2, 4), 50.0, jnp.float32)  # 4 * 100 * 50 = 20,000 > 65504 / 4
    (row, _) = ls.autocast_report(lambda w, x: jnp.sum(x @ w), w, near).rows
    assert row.overflows == "near max" and row.max_abs == 20000.0
    far = jnp.full((2, 4), 10.0, jnp.float32)  # 4,000: room to spare
    (row, _) = ls.autocast_report(lambda w, x: jnp.sum(x @ w), w, far).rows
    assert row.overflows == "" and 65504 / HEADROOM_FACTOR > 4000


def test_an_input_too_large_for_half_runs_its_equation_in_float32() -> None:
    def fn(w, x):
        return jnp.sum(jnp.tanh((x * 1e3) @ w))  # x * 1e3 is float32 (the literal), 1e5

    w, x = jnp.full((4, 3), 0.01, jnp.float32), jnp.full((2, 4), 100.0, jnp.float32)
    report = ls.autocast_report(fn, w, x)
    (row,) = report.overflows
    assert (row.primitive, row.overflows) == ("dot_general", "input")
    assert [s.primitive for s in report.policy.float32] == ["dot_general"]
    program = jax.make_jaxpr(ls.autocast(fn, policy=report.policy))(w, x)
    (dot,) = [e for e, _ in equations(program) if e.primitive.name == "dot_general"]
    assert [str(v.aval.dtype) for v in dot.invars] == ["float32", "float32"]
    np.testing.assert_allclose(ls.autocast(fn, policy=report.policy)(w, x), fn(w, x), rtol=1e-3)


def test_an_overflow_inside_a_scan_is_measured_at_every_step() -> None:
    def fn(w, x):
        def body(h, _):
            h = h @ w  # grows by 8x a step: 8**5 * 2 = 65,536 at the fifth
            return h, jnp.max(h)

        return jax.lax.scan(body, x, None, length=6)[1].sum()

    w, x = jnp.eye(4, dtype=jnp.float32) * 8.0, jnp.full((2, 4), 2.0, jnp.float32)
    report = ls.autocast_report(fn, w, x)
    dot = next(r for r in report.rows if r.primitive == "dot_general")
    assert dot.repeats == 6 and dot.overflows == "result" and dot.max_abs == np.inf
    fixed = ls.autocast(fn, policy=report.policy)(w, x)
    np.testing.assert_allclose(fixed, fn(w, x), rtol=1e-3)


def test_the_users_own_cast_to_half_is_reported_but_never_changed() -> None:
    def fn(w, x):
        return jnp.sum(((x @ w) * 1000.0).astype(jnp.float16).astype(jnp.float32))

    w, x = jnp.full((4, 3), 30.0, jnp.float32), jnp.full((2, 4), 1.0, jnp.float32)
    report = ls.autocast_report(fn, w, x)
    assert [r.primitive for r in report.overflows] == ["mul"]  # 120 * 1000 in float16
    assert [s.primitive for s in report.policy.float32_out] == ["mul"]  # fixed, then:
    (unfixed,) = report.unfixed  # the user's own astype(float16) of 120,000
    assert (unfixed.primitive, unfixed.rule) == ("convert_element_type", ls.AutocastRule.CONVERT)
    assert "still overflowing under report.policy" in str(report)


def test_the_policy_round_trips_through_json_and_reads_a_hand_written_file(tmp_path) -> None:
    _, report = _report("massive")
    path = tmp_path / "policy.json"
    report.policy.save(path)
    assert ls.AutocastPolicy.load(path) == report.policy
    assert json.loads(path.read_text())["format"] == "loss_scaling.AutocastPolicy"
    # by hand: a module in float32, matmuls included
    (tmp_path / "hand.json").write_text(json.dumps({"float32": ["LM/block_0"]}))
    policy = ls.AutocastPolicy.load(tmp_path / "hand.json")
    assert policy.float32 == (Site(path="LM/block_0"),)
    m = planted("massive")
    program = jax.make_jaxpr(m.loss(_with(policy)))(m.params, tokens(0))
    for eqn, _ in equations(program):
        if eqn.primitive.name == "dot_general":
            block_0 = str(eqn.source_info.name_stack).startswith("LM/block_0")
            assert (str(eqn.invars[0].aval.dtype) == "float32") == block_0, eqn
    assert np.isfinite(float(m.loss(_with(policy))(m.params, tokens(0))))


@pytest.mark.parametrize("data, match", [
    ({"float16": []}, r"unknown keys \['float16'\]"),
    ({"rules": {"exp": "half-ish"}}, r"rule 'half-ish' for 'exp'"),
    ({"version": 9}, "version 9"),
    ({"float32_out": [{"line": 3}]}, r"a site with unknown keys \['line'\]"),
    ({"float32": [3]}, "a policy site must be a module path"),
])
def test_a_bad_policy_file_is_refused_naming_what_is_wrong(data: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        ls.AutocastPolicy.from_dict(data)


def test_sites_match_by_module_path_source_line_and_primitive() -> None:
    assert Site.parse("model.py:42") == Site(source="model.py:42")
    assert Site.parse("LM/block_0/") == Site(path="LM/block_0")
    site = Site(path="LM/block_0", source="src/model.py:42", primitive="dot_general")
    assert site.matches("LM/block_0/wo", "/home/me/src/model.py:42", "dot_general")
    assert not site.matches("LM/block_01/wo", "/home/me/src/model.py:42", "dot_general")
    assert not site.matches("LM/block_0/wo", "/home/me/src/model.py:420", "dot_general")
    assert not site.matches("LM/block_0/wo", "/home/me/othersrc/model.py:42", "dot_general")
    assert not site.matches("LM/block_0/wo", "/home/me/src/model.py:42", "add")


def test_measure_keeps_the_largest_magnitude_of_every_iteration_by_brute_force() -> None:
    from loss_scaling.autocast.function import context
    from loss_scaling.autocast.measure import measure

    def fn(w, x):
        def body(h, _):
            return jnp.tanh(h @ w) * 3.0, None

        return jax.lax.scan(body, x, None, length=4)[0]

    w = jnp.linspace(-1.0, 1.0, 16, dtype=jnp.float32).reshape(4, 4)
    x = jnp.linspace(-2.0, 2.0, 8, dtype=jnp.float32).reshape(2, 4)
    closed = jax.make_jaxpr(fn)(w, x)
    rows = list(measure(context(jnp.float16, ls.AutocastPolicy()), closed, [w, x]).values())
    # by hand, in float16 as the rules run it: the largest |h @ w| and |3 tanh| per step
    h, dots, muls = x.astype(jnp.float16), [], []
    for _ in range(4):
        d = h @ w.astype(jnp.float16)
        dots.append(float(jnp.abs(d).max()))
        h = (jnp.tanh(d) * jnp.float16(3.0)).astype(jnp.float32).astype(jnp.float16)
        muls.append(float(jnp.abs(h).max()))
    dot = next(r for r in rows if r.primitive == "dot_general")
    mul = next(r for r in rows if r.primitive == "mul")
    assert (dot.repeats, mul.repeats) == (4, 4)
    assert dot.max_abs == max(dots) and mul.max_abs == max(muls)
