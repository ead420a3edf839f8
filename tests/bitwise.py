"""Bit-level comparison of pytrees, shared by the tests (imported as a sibling module)."""

import jax
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
