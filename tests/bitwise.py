"""Comparison of pytrees, shared by the tests (imported as a sibling module).

Two kinds of claim, two kinds of assertion (see "Numerics differ between CPUs" in the design):

- ``bits`` / ``assert_bit_identical``: where the library promises bits (a skipped step, unscale,
  the skip decision), every byte, ``-0.0`` included.
- ``assert_trees_close_in_ulps``: where two computations are only mathematically equal (the
  wrapper's step and the inner optimizer's on the true gradients, fused differently). XLA keeps
  float16 / bfloat16 intermediates at a precision that depends on the CPU's instruction set
  (native ``avx512_fp16`` arithmetic rounds every op; elsewhere a fusion runs in float32 and
  rounds once) and on its fusion boundaries, so such results agree to a few units in the last
  place *of their dtype*, not to a fixed ``rtol``: 1e-6 is a fraction of a float16 ulp.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np


def bits(tree):
    """Host copies of every leaf's bytes (survives donation of the device buffers)."""
    return [np.atleast_1d(np.asarray(x)).view(np.uint8).copy() for x in jax.tree.leaves(tree)]


def assert_bit_identical(a_bits, tree):
    """``tree``'s leaves have exactly the bytes recorded in ``a_bits`` (``-0.0`` included)."""
    b_bits = bits(tree)
    assert len(a_bits) == len(b_bits)
    for a, b in zip(a_bits, b_bits, strict=True):
        np.testing.assert_array_equal(a, b)


def ulp(x, dtype):
    """The spacing of ``dtype`` at ``|x|`` (float64), the subnormal spacing below ``tiny``."""
    info = ml_dtypes.finfo(dtype)
    magnitude = np.maximum(np.abs(np.asarray(x, np.float64)), float(info.tiny))
    return np.exp2(np.floor(np.log2(magnitude)) - info.nmant)


def ulps_apart(a, b):
    """Elementwise ``|a - b|`` in ulps of their (common, floating) dtype at the larger of them."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    wide_a, wide_b = a.astype(np.float64), b.astype(np.float64)
    return np.abs(wide_a - wide_b) / ulp(np.maximum(np.abs(wide_a), np.abs(wide_b)), a.dtype)


def assert_trees_close_in_ulps(actual, expected, max_ulps=4, floor=0.0, ulp_dtype=None):
    """Same structure and dtypes; every floating leaf within ``max_ulps`` ulps of its dtype.

    ``floor``: magnitudes below it are measured in ulps at ``floor`` (for sums whose terms
    are larger than the result). ``ulp_dtype``: count ulps of this dtype instead of each
    leaf's (where leaves are coupled, e.g. by a global norm, every leaf inherits the precision
    of the least precise one). Non-floating leaves must be equal.
    """
    leaves_a, treedef_a = jax.tree.flatten(actual)
    leaves_b, treedef_b = jax.tree.flatten(expected)
    assert treedef_a == treedef_b, (treedef_a, treedef_b)
    for i, (a, b) in enumerate(zip(leaves_a, leaves_b, strict=True)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype, f"leaf {i}: dtype {a.dtype} != {b.dtype}"
        if not jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")
            continue
        assert np.array_equal(np.isnan(a.astype(np.float64)), np.isnan(b.astype(np.float64)))
        finite = np.isfinite(a.astype(np.float64)) & np.isfinite(b.astype(np.float64))
        np.testing.assert_array_equal(a[~finite], b[~finite], err_msg=f"leaf {i}")
        wide_a, wide_b = a[finite].astype(np.float64), b[finite].astype(np.float64)
        scale = np.maximum(np.maximum(np.abs(wide_a), np.abs(wide_b)), floor)
        apart = np.abs(wide_a - wide_b) / ulp(scale, ulp_dtype or a.dtype)
        worst = float(apart.max(initial=0.0))
        assert worst <= max_ulps, (
            f"leaf {i} ({a.dtype}): {worst:.1f} ulps apart (at most {max_ulps}):\n"
            f"actual   {a!r}\nexpected {b!r}")

