"""The numerics of one step, with the argument for each shortcut next to its code: which
leaves, the reciprocal (:func:`reciprocal`), finiteness (:func:`_difference_sum`), the CPU
screen (:func:`sum_screen`), small leaves together (:func:`leaf_groups`), the step's one
read (:func:`finite_leaves`). XLA CPU compiles each distinct kernel on its own, so the step
keeps their number down (``benchmarks/compile_time.py`` measures it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

AxisName = str | Sequence[str] | None

_F32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126
_F32_MAX = float(np.finfo(np.float32).max)
_SPLIT = 2.0**64  # moves a subnormal float32 reciprocal into the normal range, exactly


def is_floating(x: Any) -> bool:
    """Whether a leaf is real or complex floating (it is scaled, unscaled and checked)."""
    return isinstance(x, (float, complex)) or (
        hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact))


def _real_dtype(dtype: Any) -> Any:
    """A complex dtype's component dtype; a real dtype itself."""
    return jnp.finfo(dtype).dtype


def compute_dtype(dtype: Any) -> Any:
    """The real dtype a leaf is (un)scaled in: float64 for 64-bit parts, else float32.

    Explicit rather than ``promote_types``, which refuses float8 / float4 types.
    """
    return jnp.float64 if jnp.finfo(dtype).bits > 32 else jnp.float32


def per_part(x: jax.Array, fn: Any) -> jax.Array:
    """``fn`` applied to a real leaf, or to a complex leaf's real and imaginary parts.

    Part by part, because a complex product ``(a + bj) * (s + 0j)`` turns an infinite
    part into NaN (``inf * 0``) and loses the sign of zeros.
    """
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return lax.complex(fn(jnp.real(x)), fn(jnp.imag(x)))
    return fn(x)


# ----------------------------------------------------------------------- the reciprocal


class Reciprocal(NamedTuple):
    """``r = float32(1 / scale)``, held as ``lifted * unlift`` with both factors normal
    (:func:`reciprocal`: ``lifted = r``, ``unlift = 1`` up to scale 2**126).

    Both factors live in one array (``factors[..., 0]``, ``factors[..., 1]``): on XLA CPU
    every scalar a kernel materializes is a kernel to compile, while a slice read by its
    consumer is fused into it.
    """

    factors: jax.Array

    @property
    def lifted(self) -> jax.Array:
        """``r``, or ``r * 2**64`` where ``r`` is subnormal: the first factor."""
        return self.factors[..., 0]

    @property
    def unlift(self) -> jax.Array:
        """1, or ``2**-64``: the power of two that takes ``lifted`` back to ``r``."""
        return self.factors[..., 1]


def _rounded_quotient(divisor: jax.Array) -> jax.Array:
    """``round(2**46 / divisor)`` for an int32 ``divisor`` in [2**23, 2**25), in int32.

    Long division: the first digit from 2**24, then 6, 6, 6 and 4 bits (24 + 22 = 46), so
    a remainder (below the divisor) shifted left stays below 2**31. The quotient is never
    a tie: a remainder of exactly half the divisor would make the divisor divide 2**47,
    a power of two, and then the division is exact. So it rounds up iff twice the
    remainder reaches the divisor.
    """
    start = jnp.full_like(divisor, 2**24)
    quotient, remainder = lax.div(start, divisor), lax.rem(start, divisor)
    for bits in (6, 6, 6, 4):
        shifted = lax.shift_left(remainder, jnp.full_like(divisor, bits))
        quotient = lax.shift_left(quotient, jnp.full_like(divisor, bits)) | lax.div(
            shifted, divisor)
        remainder = lax.rem(shifted, divisor)
    return quotient + (remainder + remainder >= divisor).astype(quotient.dtype)


def reciprocal(scale: jax.Array) -> Reciprocal:
    """The float32 reciprocal of ``scale`` as a :class:`Reciprocal` (no subnormal in it).

    ``r = float32(1 / scale)``, as PyTorch's kernel computes it. For a scale above
    2**126, ``r`` is subnormal and XLA on CPU flushes it to zero, so it is held as
    ``lifted * unlift``. Derivation: a normal float32 ``scale`` is ``m * 2**(e - 150)``
    with the biased exponent ``e`` and the integer mantissa ``m`` in ``[2**23, 2**24)``;
    in ``(2**126, 2**128)``, ``e`` is 253 or 254. The subnormal ``r`` is an integer
    multiple of 2**-149: ``r = round(2**149 / scale) * 2**-149 = round(2**(299 - e) / m)
    * 2**-149``, the quotient ``q = round(2**46 / m)`` (e = 253) or ``round(2**46 / (2 *
    m))`` (e = 254), computed by integer long division (:func:`_rounded_quotient`), so
    rounded once, never twice. ``q`` lies in ``[2**21, 2**23]``, so ``lifted = r * 2**64
    = q * 2**-85`` is exact and normal, and ``unlift = 2**-64``. ``(x * lifted) * unlift``
    is then ``round(x * q * 2**-85) * 2**-64``, which equals ``round(x * r)`` whenever
    the result is normal, since multiplying by a power of two between normal numbers
    commutes with rounding: PyTorch's bits wherever the result is a normal number. Both
    factors are at most 1.
    """
    scale = jnp.asarray(scale, jnp.float32)
    bits = lax.bitcast_convert_type(scale, jnp.int32)
    mantissa = (bits & 0x7FFFFF) | 0x800000
    # Where r is subnormal: r * 2**149 = round(2**46 / divisor), with divisor = m for
    # e = 253 (odd) and 2 * m for e = 254 (even).
    even_exponent = (lax.shift_right_logical(bits, jnp.int32(23)) & 1) ^ 1
    quotient = _rounded_quotient(lax.shift_left(mantissa, even_exponent))
    lifted_subnormal = quotient.astype(jnp.float32) * jnp.float32(2.0**-85)  # r * 2**64
    subnormal = (scale > _F32_TINY**-1) & (scale <= _F32_MAX)
    lifted = lax.select(subnormal, lifted_subnormal, 1 / scale)
    unlift = jnp.where(subnormal, jnp.float32(1 / _SPLIT), jnp.float32(1.0))
    # A barrier keeps XLA from folding (x * lifted) * unlift into x * (lifted * unlift) when
    # the scale is a compile-time constant: that product is the subnormal we avoid.
    return Reciprocal(lax.optimization_barrier(jnp.stack([lifted, unlift], axis=-1)))


def unscale_leaf(x: jax.Array, inverse: Reciprocal, cast_back: bool = True) -> jax.Array:
    """One floating leaf times the reciprocal, computed as :func:`unscale` defines it.

    Real parts are multiplied in float32 (float64 for 64-bit parts) and cast back to the
    leaf's dtype (unless ``cast_back=False``); the finite test and the wrapper's unscale
    share this function, so they agree on every input.
    """
    return _times(x, inverse.lifted, inverse.unlift, cast_back)


def _times(x: Any, lifted: jax.Array, unlift: jax.Array, cast_back: bool) -> jax.Array:
    """:func:`unscale_leaf` by the two factors, taken out of the :class:`Reciprocal` once
    per tree (the step traces this once per leaf: ``lax`` calls keep that cheap)."""
    x = jnp.asarray(x)
    compute = compute_dtype(x.dtype)
    dtype = _real_dtype(x.dtype) if cast_back else compute
    if compute == jnp.float64:
        # float64 keeps the float32 reciprocal's exact value (normal in float64).
        factor = lifted.astype(compute) * unlift.astype(compute)
        return per_part(x, lambda part: part * factor)

    def part_times(part: jax.Array) -> jax.Array:
        product = lax.mul(lax.mul(lax.convert_element_type(part, compute), lifted), unlift)
        return lax.convert_element_type(product, dtype)

    return per_part(x, part_times)


def unscale_tree(tree: Any, inverse: Reciprocal | None) -> Any:
    """Every floating leaf of ``tree`` times the reciprocal (:func:`unscale_leaf`);
    ``inverse=None`` (no scaling) returns ``tree`` itself."""
    if inverse is None:
        return tree
    lifted, unlift = inverse.lifted, inverse.unlift
    return jax.tree.map(lambda x: _times(x, lifted, unlift, True) if is_floating(x) else x, tree)


def _difference_sum(y: jax.Array) -> jax.Array:
    """``sum(y - y)`` in the compute dtype: 0 if every entry is finite, else NaN.

    IEEE arithmetic makes ``y - y`` exactly 0 for a finite entry and NaN for an inf or a
    NaN (XLA does not fold it: it is not 0 for those); a sum of zeros is 0, and a NaN
    term makes any sum NaN, whatever the order of the reduction (a *max* may drop NaN:
    XLA CPU's vectorized max does). So the sum is finite iff every entry is, and finite
    entries cannot add up to an overflow. The reduction has no constant operand: XLA CPU
    materializes the broadcast of a scalar that several reductions of one shape share (a
    leaf-sized buffer each), and it fuses the elementwise producers (the unscale) into
    the one read. A complex leaf counts both parts (``re - re + im - im``).
    """
    compute = compute_dtype(y.dtype)
    if jnp.issubdtype(y.dtype, jnp.complexfloating):
        re, im = jnp.real(y).astype(compute), jnp.imag(y).astype(compute)
        return jnp.sum((re - re) + (im - im), dtype=compute)
    y = y.astype(compute)
    return jnp.sum(y - y, dtype=compute)


def unscaled_difference_sum(x: Any, inverse: Reciprocal | None) -> jax.Array:
    """:func:`_difference_sum` of one floating leaf unscaled as :func:`unscale` computes
    it: finite iff every unscaled entry is. Several leaves' sums stacked take one
    ``isfinite`` kernel, not one each."""
    x = jnp.asarray(x)
    return _difference_sum(x if inverse is None else unscale_leaf(x, inverse))


def unscaled_finite_leaves(
    tree: Any, inverse: Reciprocal | None, axis_name: AxisName = None
) -> tuple[jax.Array, jax.Array]:
    """Per floating leaf, ``all(isfinite(unscale_leaf(x)))`` (the definition of a finite
    step), read from the scaled values by :func:`_difference_sum`: the unscaled tree is never
    materialized. ``inverse=None`` (no scaling) tests the leaves as they are; the
    ``axis_name`` collective is a ``pmin`` of one int32 per leaf.

    Returns:
      ``(flags, finite)``: a bool vector with one entry per leaf of ``tree``, in
      ``jax.tree.leaves`` order (``True`` for integer and bool leaves), and their AND.
    """
    flags = [jnp.isfinite(unscaled_difference_sum(x, inverse)) if is_floating(x)
             else jnp.asarray(True) for x in jax.tree.leaves(tree)]
    if not flags:
        return jnp.ones((0,), jnp.bool_), jnp.asarray(True)
    stacked = agree(axis_name, jnp.stack(flags))[0]
    return stacked, stacked.all()


# ------------------------------------------------------------- small leaves, together

SMALL_LEAF = 2**12
"""Leaves of at most this many entries are tested together (see :func:`leaf_groups`)."""
GROUP_ENTRIES = 2**16
"""The most entries in one group: its concatenated copy stays a few hundred KiB."""


class LeafGroup(NamedTuple):
    """Leaves (indices into a leaf list) that a finiteness test reads as one vector.

    ``joined`` groups hold small leaves of one dtype, concatenated; otherwise the group is
    one large leaf, read in place.
    """

    indices: tuple[int, ...]
    joined: bool


def _sharded_in_type(x: Any) -> bool:
    """Whether ``x``'s type splits it over mesh axes (explicit sharding), which a
    concatenation cannot flatten without a resharding."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec is not None and any(axes is not None for axes in spec)


def varying_axes(x: Any) -> frozenset[Any]:
    """The ``shard_map`` axes over which ``x`` (an array or a ShapeDtypeStruct) varies."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def leaf_groups(leaves: Sequence[Any]) -> list[LeafGroup]:
    """Partitions the floating, non-empty leaves for the finiteness tests on XLA CPU.

    Each kernel of an XLA CPU executable costs about a microsecond per run, which is all a
    reduction over a small leaf takes, and a model has dozens of small leaves (biases,
    norms). Leaves of at most :data:`SMALL_LEAF` entries are therefore concatenated, per
    dtype and up to :data:`GROUP_ENTRIES` entries, and tested as one vector; a larger leaf,
    or one whose type is sharded over a mesh axis, is tested on its own. Integer, bool
    and empty leaves are in no group (always finite).
    """
    groups: list[LeafGroup] = []
    open_groups: dict[Any, list[int]] = {}
    open_entries: dict[Any, int] = {}
    for i, x in enumerate(leaves):
        size = int(np.size(x))
        if not is_floating(x) or not size:
            continue
        if size > SMALL_LEAF or _sharded_in_type(x):
            groups.append(LeafGroup((i,), joined=False))
            continue
        # One dtype, and under shard_map one set of varying axes: a group's sum of squares
        # is then a whole leaf's or a shard's, never a mix (see the gradient norm).
        key = (jnp.result_type(x), varying_axes(x))
        members = open_groups.setdefault(key, [])
        if open_entries.get(key, 0) + size > GROUP_ENTRIES:
            groups.append(LeafGroup(tuple(members), joined=True))
            members.clear()
            open_entries[key] = 0
        members.append(i)
        open_entries[key] = open_entries.get(key, 0) + size
    groups.extend(LeafGroup(tuple(m), joined=True) for m in open_groups.values() if m)
    return groups


def leaf_order(groups: Sequence[LeafGroup], n: int) -> tuple[int, np.ndarray | None]:
    """For one flag per leaf, concatenated group by group and then the leaves in no group:
    how many leaves are in no group, and the permutation back to leaf order (or ``None``)."""
    order = [i for group in groups for i in group.indices]
    order += sorted(set(range(n)) - set(order))
    permutation = np.argsort(np.asarray(order, np.int64))
    return n - sum(len(g.indices) for g in groups), (
        None if np.array_equal(permutation, np.arange(n)) else permutation)


def group_vector(leaves: Sequence[Any], group: LeafGroup) -> jax.Array:
    """The group's leaves as one array: the leaf itself, or a concatenated copy.

    Made once per step by :func:`finite_leaves` and read by the screen, the exact test
    and the max (the copy lives until the last of their conditionals). The barrier
    keeps XLA from splitting a reduction of the concatenation back into one reduction
    per leaf, which is what the group is there to avoid.
    """
    if not group.joined:
        return jnp.asarray(leaves[group.indices[0]])
    parts = [lax.reshape(jnp.asarray(leaves[i]), (int(np.size(leaves[i])),))
             for i in group.indices]
    return lax.optimization_barrier(lax.concatenate(parts, 0))


def sum_screen(vector: jax.Array) -> jax.Array:
    """The sum of squares of a group's vector (a scalar, float32 or float64): finite
    only if every entry is, so it screens them for inf and NaN; it also gives the norm.

    The squares are >= 0, so an inf or NaN entry makes the sum inf or NaN: a finite sum
    proves every scaled entry finite (one that overflowed proves nothing; the caller then
    runs the exact test). That is enough when ``scale >= 1``: both reciprocal factors are
    then at most 1, so ``|round(x * r)| <= |x|`` (rounding is monotonic and ``|x|`` is
    representable), also after the cast back to the leaf's dtype, where ``x`` came from:
    unscaling a finite entry cannot overflow. Below scale 1 the screen clears nothing.
    On XLA CPU it is one vectorized read of the leaves, as a plain sum is (and it gives
    the norm). Complex entries count ``re**2 + im**2``.
    """
    compute = compute_dtype(vector.dtype)
    parts = ([jnp.real(vector), jnp.imag(vector)]
             if jnp.issubdtype(vector.dtype, jnp.complexfloating) else [vector])
    return sum((jnp.sum(jnp.square(p.astype(compute)), dtype=compute) for p in parts),
               jnp.zeros((), compute))


def all_rows(flags: jax.Array) -> jax.Array:
    """``flags.all(axis=-1)`` as a min of int8: on XLA CPU a boolean AND-reduction is
    rewritten into a tree of reduce-windows, each a kernel to compile; a min is one."""
    return jnp.min(flags.astype(jnp.int8), axis=-1) == 1


Factors = tuple[jax.Array, jax.Array] | None
"""A :class:`Reciprocal`'s two scalars (``lifted``, ``unlift``) handed to a conditional as
two operands: sliced once outside, not once in each branch; ``None``: no scaling."""


def _unscaled(x: jax.Array, factors: Factors) -> jax.Array:
    """:func:`unscale_leaf` by the reciprocal's two scalars (``None``: ``x`` itself)."""
    return x if factors is None else _times(x, *factors, True)


def unscaled_group_finite(vector: jax.Array, sizes: Sequence[int],
                          factors: Factors) -> jax.Array:
    """Per leaf of a joined group, whether it is all finite unscaled (a bool vector), from
    the group's :func:`group_vector` and its leaves' sizes in order.

    The vector is unscaled element by element (one dtype, so exactly as each leaf alone)
    and its flags gathered per leaf by one segment reduction: a few kernels for any number
    of small leaves and sizes (one reduction per run of equal sizes: 4x slower to compile
    with 28 sizes in 40 leaves).
    """
    finite = jnp.isfinite(_unscaled(vector, factors))
    segments = jnp.asarray(np.repeat(np.arange(len(sizes), dtype=np.int32), sizes))
    return jax.ops.segment_min(finite.astype(jnp.int8), segments, len(sizes),
                               indices_are_sorted=True) == 1


# ------------------------------------------- the one read of the gradients (the step)


def _vary(x: Any, axes: frozenset[Any]) -> Any:
    missing = axes - varying_axes(x)
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
    axes = jax.tree.map(lambda a, b: varying_axes(a) | varying_axes(b), stepped, skipped)

    def cast(branch: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return lambda operands: jax.tree.map(_vary, branch(operands), axes)

    return lax.cond(apply, cast(step), cast(skip_step), operands)


# ------------------------------------------------------------- the norm, over replicas


def replica_square_sum(sums: Sequence[jax.Array], axis_name: AxisName) -> jax.Array:
    """The float32 total of per-group (or per-leaf) sums of squares, for the norm.

    Under ``shard_map`` a sum that varies over some of the ``axis_name`` axes is a shard's
    part of a leaf split over them (tensor parallelism): those parts add up (``psum``),
    while a sum invariant over an axis is already the whole leaf's (replicated, e.g.
    ``pmean``-ed, gradients; :func:`loss_scaling.core.leaf_groups` never joins
    the two kinds).
    """
    names = _axis_names(axis_name)
    total = jnp.zeros((), jnp.float32)
    for part in sums:
        part = part.astype(jnp.float32)
        split = tuple(a for a in names if a in varying_axes(part))
        total = total + (lax.psum(part, split) if split else part)
    return total


def normalized_axis_name(axis_name: Any) -> AxisName:
    """``axis_name`` as the collectives and a static ``jit`` argument take it: a list of
    names as a tuple (hashable), anything else as it is."""
    return tuple(axis_name) if isinstance(axis_name, list) else axis_name


def _axis_names(axis_name: AxisName) -> tuple[Any, ...]:
    """The names in ``axis_name`` (``()`` for ``None``)."""
    axis_name = normalized_axis_name(axis_name)
    if axis_name is None:
        return ()
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def agree(axis_name: AxisName, flags: jax.Array | None = None,
          *maxima: jax.Array) -> tuple[jax.Array, ...]:
    """The one agreement over replicas: ``flags`` ANDed and each of ``maxima`` the largest
    over ``axis_name``, in ONE ``pmin``; ``(flags, *maxima)`` (``flags`` None: the maxima).

    A flag is a min of 0/1 (int32 when alone: no NaN to drop); a maximum is
    ``-pmin(-x)``, a NaN read as +inf first (with or without replicas): the min of an
    all-reduce need not propagate NaN (XLA CPU's does not), and a NaN norm or max is then
    inf on every path and device. Where JAX does not track what varies (``pmap``,
    ``check_vma=False``) the replicas' gradients are taken to be the same, and the largest
    value (an inf on one replica reaches all) is the one every replica reports.
    """
    maxima = tuple(jnp.where(jnp.isnan(x), jnp.inf, x) for x in maxima)
    head = () if flags is None else (flags,)
    if axis_name is None:
        return (*head, *maxima)
    if not maxima:
        assert flags is not None
        return (lax.pmin(flags.astype(jnp.int32), axis_name) == 1,)
    if flags is None and len(maxima) == 1:
        return (-lax.pmin(-maxima[0], axis_name),)
    n = 0 if flags is None else flags.shape[0]
    every = lax.pmin(jnp.concatenate(
        [*(f.astype(jnp.float32) for f in head), *(-x[None] for x in maxima)]), axis_name)
    return (*((every[:n] == 1,) if flags is not None else ()),
            *(-every[n + i] for i in range(len(maxima))))


def group_peak(x: jax.Array) -> jax.Array:
    """The largest ``|entry|`` of a group's vector as float32 (complex: the modulus), as
    :func:`loss_scaling.grads_max` computes it. Not the root of the largest square, which
    overflows above ~1.8e19 ("no room" for ever with ``headroom_dtype`` float32) and
    flushes to 0 below ~1.1e-19 (an empty entry, though the gradients are not zero)."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def peak_of(vectors: Sequence[jax.Array]) -> jax.Array:
    """The largest :func:`group_peak` of several vectors, float32 (0 for none)."""
    peaks = [group_peak(x) for x in vectors]
    return jnp.max(jnp.stack(peaks)) if peaks else jnp.zeros((), jnp.float32)


def floating_leaves(tree: Any) -> list[jax.Array]:
    """The floating, non-empty leaves of ``tree`` (what the norm and the max read)."""
    return [jnp.asarray(x) for x in jax.tree.leaves(tree) if is_floating(x) and jnp.size(x)]


def finite_leaves(grads: Any, inverse: Reciprocal | None, axis_name: AxisName,
                  measure: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array,
                                                             jax.Array | None]:
    """Per gradient leaf, whether its unscaled values are all finite; their AND; the
    float32 sum of squares of the scaled gradients, for the norm; and with ``measure``
    (``growth="headroom"``: whether the rule records this step's max, a bool) the largest
    |entry| of the scaled gradients (:func:`group_peak`, agreed over ``axis_name``), else
    None.

    On CPU the leaves are first screened by sums of squares (:func:`sum_screen`), the one
    reduction XLA CPU vectorizes (3x faster than one with the unscale or ``abs`` as its
    producer, benchmarks/step_breakdown.py), small leaves joined (:func:`leaf_groups`);
    only a group not cleared runs the exact test (:func:`_exact_flags`, under a
    conditional). Other backends run the exact test directly (a conditional can cost them
    a host round trip), the max a sibling reduction of the same read in the same
    collective. XLA CPU does not fuse a second reduction into the screen's sum (10-20x
    slower, benchmarks/headroom_cost.py): there the max is a second read with its own
    collective, under a conditional that runs it only on the steps that record it (and
    are finite; else 0, which the rule ignores: :func:`loss_scaling.core.headroom.records_max`);
    with small leaves only, where the conditional costs more than the read, on every step.
    """
    leaves = jax.tree.leaves(grads)
    groups = leaf_groups(leaves)
    if jax.default_backend() != "cpu" or not groups:
        return _exact_test(grads, inverse, axis_name, measure is not None)
    small_reciprocal = jnp.asarray(True)
    if inverse is not None:
        small_reciprocal = (inverse.lifted <= 1) | (inverse.unlift < 1)
    # The joined groups' vectors are made once: the exact test and the max read them too
    # (copied again in each conditional they cost a kernel per small leaf to compile).
    vectors = [group_vector(leaves, group) for group in groups]
    sums = [sum_screen(x) for x in vectors]
    cleared = [jnp.isfinite(x) & small_reciprocal for x in sums]
    # The branch must be the same on every replica: one collective for it and the norm.
    all_cleared, squares = agree(
        axis_name, all_rows(jnp.stack(cleared))[None], replica_square_sum(sums, axis_name))
    all_cleared = all_cleared[0]

    def exact(_: Any) -> tuple[jax.Array, jax.Array]:
        return _exact_flags(leaves, groups, vectors, cleared, inverse, axis_name)

    n = len(leaves)
    flags, finite = skip_cond(all_cleared,
                              lambda _: (jnp.ones((n,), jnp.bool_), jnp.asarray(True)),
                              exact, None)
    grads_max = None
    if measure is not None:
        grads_max = _read_max(vectors, groups, axis_name, measure & finite)
    return flags, finite, squares, grads_max


def _exact_flags(leaves: list[Any], groups: list[LeafGroup], vectors: list[jax.Array],
                 cleared: list[jax.Array], inverse: Reciprocal | None,
                 axis_name: AxisName) -> tuple[jax.Array, jax.Array]:
    """The branch :func:`finite_leaves` takes when the screen did not clear every group:
    the exact test per leaf (in leaf order, agreed over ``axis_name``) and their AND.

    Each group is tested under a conditional of its own, taken only where the screen did
    not clear it: a large leaf by one fused reduction (a :func:`_difference_sum` of it
    unscaled, float32), a joined group by :func:`unscaled_group_finite` on the vector the
    screen read. A group the screen cleared is finite without a second read, so a skipped
    step rereads about what overflowed, not the whole model. The conditionals also keep
    the scratch memory flat: in one computation, XLA CPU shares the broadcast of each
    reciprocal factor between the reductions of every leaf of one shape and keeps it as
    a buffer of that shape (5.73 MiB at 20M params in 40 leaves, 11.4 MiB at 4M in 4);
    in a branch of its own the broadcast has one reader and is fused into it. The cost is
    to compile: a conditional and a few kernels a group (its predicate; the reciprocal's
    two scalars are sliced once, outside), where the reread is one fused reduction in any
    case (a 12-layer GPT's train step: 2,279 kernels and 32 conditionals, against 2,243
    and 2 with every group reread in one computation; ``benchmarks/train_step_compile.py
    --counts``). The large leaves' sums take one ``isfinite``; one static permutation
    puts the flags in leaf order.
    """
    factors = None if inverse is None else (inverse.lifted, inverse.unlift)
    sums, joined_flags = [], []
    for group, vector, ok in zip(groups, vectors, cleared, strict=True):
        if group.joined:
            sizes = [int(np.size(leaves[i])) for i in group.indices]
            joined_flags.append(skip_cond(ok, functools.partial(_all_true, len(sizes)),
                                          functools.partial(_group_flags, sizes),
                                          (vector, factors)))
        else:
            sums.append(skip_cond(ok, _zero, _leaf_sum, (vector, factors)))
    parts = ([jnp.isfinite(jnp.stack(sums))] if sums else []) + joined_flags
    ordered = ([group for group in groups if not group.joined]
               + [group for group in groups if group.joined])
    ungrouped, permutation = leaf_order(ordered, len(leaves))
    if ungrouped:  # integer, bool and empty leaves: always finite
        parts.append(jnp.ones((ungrouped,), jnp.bool_))
    stacked = jnp.concatenate(parts)
    if permutation is not None:
        stacked = stacked[permutation]
    stacked = agree(axis_name, stacked)[0]
    return stacked, all_rows(stacked)


def _leaf_sum(operands: tuple[jax.Array, Factors]) -> jax.Array:
    return _difference_sum(_unscaled(*operands)).astype(jnp.float32)


def _group_flags(sizes: list[int], operands: tuple[jax.Array, Factors]) -> jax.Array:
    return unscaled_group_finite(operands[0], sizes, operands[1])


def _zero(_: Any) -> jax.Array:
    return jnp.zeros((), jnp.float32)


def _all_true(n: int, _: Any) -> jax.Array:
    return jnp.ones((n,), jnp.bool_)


def _exact_test(grads: Any, inverse: Reciprocal | None, axis_name: AxisName,
                with_max: bool) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """:func:`finite_leaves` off CPU: the exact test, and sibling reductions of the same
    leaves for the norm (and the max), which XLA fuses into one read on GPU."""
    leaves = floating_leaves(grads)
    squares = replica_square_sum([sum_screen(x) for x in leaves], axis_name)
    flags, _ = unscaled_finite_leaves(grads, inverse, None)
    if with_max:
        flags, squares, peak = agree(axis_name, flags, squares, peak_of(leaves))
        return flags, flags.all(), squares, peak
    flags, squares = agree(axis_name, flags, squares)
    return flags, flags.all(), squares, None


def _read_max(vectors: list[jax.Array], groups: list[LeafGroup],
              axis_name: AxisName, read: jax.Array) -> jax.Array:
    """On CPU: the max |entry| in a pass of its own under a conditional (0 unless
    ``read``), agreed over ``axis_name`` by its own ``pmin`` (NaN-safe)."""
    def read_max(_: Any) -> jax.Array:
        return agree(axis_name, None, peak_of(vectors))[0]

    if all(group.joined for group in groups):
        # Only small leaves, concatenated: a few small kernels on every step cost less
        # than a conditional around them (4k params: 1.13x -> 1.10x the default step,
        # benchmarks/headroom_cost.py); `read` still zeroes the steps it does not record.
        return jnp.where(read, read_max(None), jnp.zeros((), jnp.float32))
    return skip_cond(read, read_max, lambda _: jnp.zeros((), jnp.float32), None)
