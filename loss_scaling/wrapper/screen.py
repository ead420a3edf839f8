"""The one read of the gradients: per-leaf finite flags and the sum of squares, and the
conditional that guards a step (valid under ``shard_map``).

:func:`finite_leaves` is where the CPU sum screen (its soundness argument is in
:mod:`loss_scaling.core.numerics`) meets the exact test; :func:`skip_cond` is the
``lax.cond`` of both the screen and the guarded step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from loss_scaling.core import numerics
from loss_scaling.core.numerics import AxisName

_varying_axes = numerics.varying_axes


def _vary(x: Any, axes: frozenset[Any]) -> Any:
    missing = axes - _varying_axes(x)
    return lax.pcast(x, tuple(sorted(missing, key=str)), to="varying") if missing else x


def skip_cond(apply: jax.Array, step: Callable[[Any], Any], skip_step: Callable[[Any], Any],
               operands: Any) -> Any:
    """``lax.cond(apply, step, skip_step, operands)``, valid under ``shard_map``'s vma checks.

    Inside ``shard_map`` the two branches can disagree on the mesh axes an output varies
    over, e.g. tensor-parallel updates vary over "model" where the ``-0.0`` of a skip does
    not. Each output is cast to the union of both (``pcast`` to varying: a change of type,
    no communication), so the cond type-checks and the shard_map's ``out_specs`` judge
    the result. Outside ``shard_map`` this is a plain ``lax.cond``; with a concrete
    ``apply`` (eagerly, no trace) the taken branch is called.
    """
    if not isinstance(apply, jax.core.Tracer):
        # Called eagerly, lax.cond traces both branches anew and compiles them at every
        # call (a step cost several compiles); the taken branch, op by op, gives the values
        # (as arrays, as the conditional returns them).
        return jax.tree.map(jnp.asarray, step(operands) if bool(apply) else skip_step(operands))
    if not jax.sharding.get_abstract_mesh().manual_axes:
        return lax.cond(apply, step, skip_step, operands)
    stepped, skipped = (jax.eval_shape(f, operands) for f in (step, skip_step))
    axes = jax.tree.map(lambda a, b: _varying_axes(a) | _varying_axes(b), stepped, skipped)

    def cast(branch: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return lambda operands: jax.tree.map(_vary, branch(operands), axes)

    return lax.cond(apply, cast(step), cast(skip_step), operands)


# ------------------------------------------------------------- the norm, over replicas


def replica_square_sum(sums: Sequence[jax.Array], axis_name: AxisName) -> jax.Array:
    """The float32 total of per-group (or per-leaf) sums of squares, for the norm.

    Under ``shard_map`` a sum that varies over some of the ``axis_name`` axes is a shard's
    part of a leaf split over them (tensor parallelism): those parts add up (``psum``),
    while a sum invariant over an axis is already the whole leaf's (replicated, e.g.
    ``pmean``-ed, gradients; :func:`loss_scaling.core.numerics.leaf_groups` never joins
    the two kinds).
    """
    names = _axis_names(axis_name)
    total = jnp.zeros((), jnp.float32)
    for part in sums:
        part = part.astype(jnp.float32)
        split = tuple(a for a in names if a in _varying_axes(part))
        total = total + (lax.psum(part, split) if split else part)
    return total


def _axis_names(axis_name: AxisName) -> tuple[Any, ...]:
    if axis_name is None:
        return ()
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def agree(flags: jax.Array, squares: jax.Array, axis_name: AxisName,
          peak: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Flags ANDed, and the sum of squares made one value, over the replicas: ONE ``pmin``.

    ``pmin(-x)`` is ``-pmax(x)``: where JAX does not track what varies (``pmap``,
    ``check_vma=False``) the replicas' gradients are taken to be the same, and the largest
    sum (an inf on one replica reaches all) is the one every replica reports. A NaN sum
    reads +inf first: the min of an all-reduce need not propagate NaN, and the norm of
    non-finite gradients is then inf on every path and device. A ``peak`` (the largest
    |entry|, headroom growth) rides in the same ``pmin``: ``(flags, squares, peak)``.
    """
    maxima = [jnp.where(jnp.isnan(x), jnp.inf, x) for x in (squares, peak) if x is not None]
    if axis_name is None:
        return (flags, *maxima)
    every = lax.pmin(jnp.concatenate([flags.astype(jnp.float32), *(-x[None] for x in maxima)]),
                     axis_name)
    n = flags.shape[0]
    return (every[:n] == 1, *(-every[n + i] for i in range(len(maxima))))


def group_peak(x: jax.Array) -> jax.Array:
    """The largest ``|entry|`` of a group's vector as float32, as
    :func:`loss_scaling.grads_max` computes it (complex: the modulus).

    The magnitude itself, not the square root of the largest square: a square leaves
    float32's range for an entry above ~1.8e19 (it would read inf, "no room", for ever
    with ``headroom_dtype`` float32 or bfloat16) and flushes to 0 below ~1.1e-19 (an
    empty entry, though the gradients are not zero).
    """
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def leaf_peak(x: Any) -> jax.Array:
    """``max(|x|)`` of one floating leaf as float32 (0 for other and empty leaves)."""
    if not numerics.is_floating(x) or not jnp.size(x):
        return jnp.zeros((), jnp.float32)
    return group_peak(jnp.asarray(x))


def _peak(peaks: list[jax.Array]) -> jax.Array:
    """The largest of per-leaf (or per-group) maxima, float32 (0 for none)."""
    return jnp.max(jnp.stack(peaks)) if peaks else jnp.zeros((), jnp.float32)


def finite_leaves(grads: Any, inverse: numerics.Reciprocal | None, axis_name: AxisName,
                  measure: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array,
                                                             jax.Array | None]:
    """Per gradient leaf, whether its unscaled values are all finite; their AND; the
    sum of squares of the (scaled) gradients, in float32, for the norm; and with
    ``measure`` (``growth="headroom"``: whether the rule records this step's max, a
    bool) the largest |entry| of the scaled gradients (float32, agreed over
    ``axis_name``), else None.

    The max is that of the magnitudes (:func:`group_peak`). Off CPU it is a sibling
    reduction of the same leaves the norm reads (one read), taken in the same collective,
    on every step.
    XLA on CPU does not fuse a second reduction into the screen's vectorized sum (a
    multi-output reduction ran 10-20x slower than the sum, benchmarks/headroom_cost.py):
    there the max is a second read with its own collective, under a conditional that
    runs it only on the steps that record it (and are finite); a model of small leaves
    only, where the conditional costs more than the read, reads it on every step. On the
    other steps it is 0, which the rule ignores
    (:func:`loss_scaling.core.update.records_max`).

    On CPU the leaves are first screened by sums of squares, the one reduction XLA CPU
    vectorizes (about 3x faster than one with the unscale or ``abs`` as its producer,
    benchmarks/step_breakdown.py), small leaves joined
    (:func:`loss_scaling.core.numerics.leaf_groups`); why a finite sum clears a group is
    argued in :mod:`loss_scaling.core.numerics`. Only if a group is not cleared does the
    exact test run (:func:`_exact_flags`, under a conditional). Other backends run the
    exact test directly: a conditional can cost them a host round trip.
    """
    leaves = jax.tree.leaves(grads)
    groups = numerics.leaf_groups(leaves)
    if jax.default_backend() != "cpu" or not groups:
        return _exact_test(grads, inverse, axis_name, measure is not None)
    small_reciprocal = jnp.asarray(True)
    if inverse is not None:
        small_reciprocal = (inverse.lifted <= 1) | (inverse.unlift < 1)
    sums = [numerics.sum_screen(numerics.group_vector(leaves, group)) for group in groups]
    cleared = [jnp.isfinite(x) & small_reciprocal for x in sums]
    # The branch must be the same on every replica: one collective for it and the norm.
    all_cleared, squares = agree(
        numerics.all_rows(jnp.stack(cleared))[None], replica_square_sum(sums, axis_name),
        axis_name)
    all_cleared = all_cleared[0]

    def exact(_: Any) -> tuple[jax.Array, jax.Array]:
        return _exact_flags(leaves, groups, inverse, axis_name)

    n = len(leaves)
    flags, finite = skip_cond(all_cleared,
                              lambda _: (jnp.ones((n,), jnp.bool_), jnp.asarray(True)),
                              exact, None)
    grads_max = None
    if measure is not None:
        grads_max = _read_max(leaves, groups, axis_name, measure & finite)
    return flags, finite, squares, grads_max


def _exact_flags(leaves: list[Any], groups: list[numerics.LeafGroup],
                 inverse: numerics.Reciprocal | None,
                 axis_name: AxisName) -> tuple[jax.Array, jax.Array]:
    """The branch :func:`finite_leaves` takes when the screen did not clear every group:
    the exact test per leaf (in leaf order, agreed over ``axis_name``) and their AND.

    One computation kept small, because XLA compiles every kernel of it on each compile,
    taken or not: a large leaf is one fused reduction
    (:func:`~loss_scaling.core.numerics.unscaled_bounded_sum`), their sums take one
    ``isfinite``, and a joined group is concatenated again (the copy lives only while
    this rare branch runs) and tested by one segment reduction. It rereads every group,
    cleared or not, on steps that are skipped anyway: a conditional per large leaf, to
    reread only what overflowed, cost four kernels and a conditional a leaf to compile
    (a 12-layer GPT's train step: 2,395 -> 2,293 kernels, 28 -> 2 conditionals,
    ``benchmarks/train_step_compile.py --counts``). The flags are put in leaf order by
    one static permutation.
    """
    sums: dict[Any, list[tuple[numerics.LeafGroup, jax.Array]]] = {}
    for group in groups:
        if not group.joined:  # one stack per compute dtype: a cast could overflow
            x = numerics.unscaled_bounded_sum(leaves[group.indices[0]], inverse)
            sums.setdefault(x.dtype, []).append((group, x))
    large = [group for pairs in sums.values() for group, _ in pairs]
    parts = [jnp.isfinite(jnp.stack([x for _, x in pairs])) for pairs in sums.values()]
    joined = [group for group in groups if group.joined]
    for group in joined:
        sizes = [int(np.size(leaves[i])) for i in group.indices]
        parts.append(numerics.unscaled_group_finite(numerics.group_vector(leaves, group),
                                                    sizes, inverse))
    ungrouped, permutation = numerics.leaf_order(large + joined, len(leaves))
    if ungrouped:  # integer, bool and empty leaves: always finite
        parts.append(jnp.ones((ungrouped,), jnp.bool_))
    stacked = jnp.concatenate(parts)
    if permutation is not None:
        stacked = stacked[permutation]
    if axis_name is not None:
        stacked = lax.pmin(stacked.astype(jnp.int32), axis_name) == 1
    return stacked, numerics.all_rows(stacked)


def _exact_test(grads: Any, inverse: numerics.Reciprocal | None, axis_name: AxisName,
                with_max: bool) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """:func:`finite_leaves` off CPU: the exact test, and sibling reductions of the same
    leaves for the norm (and the max), which XLA fuses into one read on GPU."""
    leaves = jax.tree.leaves(grads)
    squares = replica_square_sum([numerics.square_sum(x) for x in leaves], axis_name)
    flags, _ = numerics.unscaled_finite_leaves(grads, inverse, None)
    if with_max:
        flags, squares, peak = agree(
            flags, squares, axis_name, _peak([leaf_peak(x) for x in leaves]))
        return flags, flags.all(), squares, peak
    flags, squares = agree(flags, squares, axis_name)
    return flags, flags.all(), squares, None


def _read_max(leaves: list[Any], groups: list[numerics.LeafGroup],
              axis_name: AxisName, read: jax.Array) -> jax.Array:
    """On CPU: the max |entry| in a pass of its own under a conditional (0 unless
    ``read``), agreed over ``axis_name`` by its own ``pmin`` (NaN-safe)."""
    def read_max(_: Any) -> jax.Array:
        peak = _peak([group_peak(numerics.group_vector(leaves, group)) for group in groups])
        if axis_name is not None:
            peak = -lax.pmin(-jnp.where(jnp.isnan(peak), jnp.inf, peak), axis_name)
        return peak

    if all(group.joined for group in groups):
        # Only small leaves, concatenated: a few small kernels on every step cost less
        # than a conditional around them (4k params: 1.13x -> 1.10x the default step,
        # benchmarks/headroom_cost.py); `read` still zeroes the steps it does not record.
        return jnp.where(read, read_max(None), jnp.zeros((), jnp.float32))
    return skip_cond(read, read_max, lambda _: jnp.zeros((), jnp.float32), None)
