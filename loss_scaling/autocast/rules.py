"""The rules of :func:`loss_scaling.autocast`, as data: one entry per primitive.

:data:`RULES` maps a primitive's name to the :class:`Rule` that decides the dtype it runs
in; `rewrite.py` reads it in one loop, docs/autocast.md prints it (a test holds the page
to this table). README.md says where each rule comes from.
"""

from __future__ import annotations

import enum


class Rule(enum.Enum):
    """How an equation of a float32 program runs under autocast (:data:`DESCRIPTIONS`)."""

    HALF = "half"
    HALF_FLOAT32_OUT = "half, float32 out"
    FLOAT32 = "float32"
    WIDEST = "widest"
    EACH = "each"
    AS_WRITTEN = "as written"
    CONVERT = "convert"
    CALL = "call"
    LOOP = "loop"
    CUSTOM = "custom rule"
    UNKNOWN = "unknown"


DESCRIPTIONS: dict[Rule, str] = {
    Rule.HALF: (
        "Its float32 operands are cast to the half dtype; the result is half (`dot_general`, "
        "convolutions: the FLOPs)."),
    Rule.HALF_FLOAT32_OUT: (
        "Half operands, float32 accumulation and result (`preferred_element_type`): a matmul "
        "whose result overflows the half dtype (a policy's choice, never the default)."),
    Rule.FLOAT32: (
        "Its operands are cast to float32: a range or precision the half dtype lacks (`exp`, "
        "`log`, sums, powers)."),
    Rule.WIDEST: (
        "It runs in the widest floating dtype among its operands: one operand keeps its dtype, "
        "several meet at the widest. A scalar literal joins only when the half dtype would "
        "round it to 0, a subnormal or inf (an `eps` of `1e-8` stays `1e-8`). A bias added "
        "to a half matmul result (a vector along the last axis) is cast to half, as torch's "
        "`linear` adds it; its gradient is still summed in float32."),
    Rule.EACH: (
        "Every operand keeps its own dtype (several independent values in one equation: "
        "`psum` of a tuple, `optimization_barrier`, multi-operand `sort`)."),
    Rule.AS_WRITTEN: (
        "It runs exactly as written, in the dtypes of the float32 program: dtype-specific "
        "primitives (bit casts, callbacks, linear algebra, random bits)."),
    Rule.CONVERT: (
        "The user's own `astype`: the dtype it names is kept."),
    Rule.CALL: (
        "A sub-program (`jit`, `checkpoint`, `shard_map`, `cond`): rewritten inside, "
        "its inputs and outputs in the dtypes they arrive in."),
    Rule.LOOP: (
        "`scan` and `while`: rewritten inside; the loop carry keeps its dtype (cast at "
        "entry and exit), a float32 loop-invariant is cast once, outside."),
    Rule.CUSTOM: (
        "`custom_jvp` / `custom_vjp`: the author's rule is kept, and its inputs and "
        "outputs go back to the dtypes it was written for; the code inside is rewritten like "
        "the rest."),
    Rule.UNKNOWN: (
        "Not in the table: it runs as written (float32), and the report marks it."),
}
"""What each rule does, in the words docs/autocast.md shows."""


_HALF = ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general")

_FLOAT32 = (
    # range: exp overflows above ~11 in float16, log/pow/rsqrt of small or large values
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square", "rsqrt",
    "sinh", "cosh", "tan", "asin", "acos", "asinh", "acosh", "atanh",
    # special functions (torch's float32 list)
    "erf_inv", "erfc", "lgamma", "digamma", "polygamma", "igamma", "igammac",
    "igamma_grad_a", "random_gamma_grad", "bessel_i0e", "bessel_i1e", "zeta",
    "regularized_incomplete_beta",
    # sums and products: softmax, norms, means and losses are sums
    "reduce_sum", "reduce_prod", "reduce_window_sum", "cumsum", "cumprod",
    "cumlogsumexp",
)

_WIDEST = (
    # arithmetic and comparisons
    "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "atan2",
    "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge",
    # unary ops that keep the range of their input
    "neg", "abs", "sign", "floor", "ceil", "round", "is_finite", "sqrt", "cbrt", "tanh",
    "logistic", "sin", "cos", "atan", "erf",
    # layout and data movement
    "reshape", "transpose", "broadcast_in_dim", "broadcast_to", "squeeze", "expand_dims",
    "rev", "slice", "dynamic_slice", "dynamic_update_slice", "gather", "concatenate", "pad",
    "split", "tile", "copy", "copy_p", "stop_gradient", "name", "sharding_constraint",
    "reshard", "mesh_cast", "layout_constraint", "zeros_like",
    "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max",
    # selections: a max or an index is exact in any dtype
    "reduce_max", "reduce_min", "argmax", "argmin", "cummax", "cummin", "top_k",
    "approx_top_k", "reduce_window_max", "reduce_window_min", "select_and_scatter_add",
)

_EACH = (
    "psum", "pmax", "pmin", "pvary", "pbroadcast", "ppermute", "all_gather", "all_to_all",
    "reduce_scatter", "psum_invariant", "all_gather_invariant", "optimization_barrier",
    "device_put", "sort",
)

_AS_WRITTEN = (
    "bitcast_convert_type", "reduce_precision", "nextafter", "iota", "rng_uniform",
    "rng_bit_generator", "random_bits", "random_seed", "random_wrap", "random_unwrap",
    "random_split", "random_fold_in", "random_gamma", "threefry2x32",
    "debug_callback", "debug_print", "pure_callback", "io_callback", "ffi_call",
    "cholesky", "eigh", "eig", "lu", "qr", "svd", "schur", "hessenberg",
    "triangular_solve", "tridiagonal", "tridiagonal_solve", "householder_product",
    "geqrf", "geqp3", "ormqr", "custom_linear_solve", "linear_call", "fft",
    "reduce", "reduce_window", "select_and_gather_add", "composite", "real", "imag",
    "complex", "conj", "xla_pmap", "xla_call", "custom_partitioning",
)

RULES: dict[str, Rule] = {
    **dict.fromkeys(_HALF, Rule.HALF),
    **dict.fromkeys(_FLOAT32, Rule.FLOAT32),
    **dict.fromkeys(_WIDEST, Rule.WIDEST),
    **dict.fromkeys(_EACH, Rule.EACH),
    **dict.fromkeys(_AS_WRITTEN, Rule.AS_WRITTEN),
    "convert_element_type": Rule.CONVERT,
    **dict.fromkeys(("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint",
                     "shard_map", "cond"), Rule.CALL),
    **dict.fromkeys(("scan", "while"), Rule.LOOP),
    **dict.fromkeys(("custom_jvp_call", "custom_vjp_call"), Rule.CUSTOM),
}
"""Primitive name -> :class:`Rule`. A primitive not in the table is :attr:`Rule.UNKNOWN`."""


def rule_of(primitive: str) -> Rule:
    """The rule of a primitive (:attr:`Rule.UNKNOWN` when the table does not name it)."""
    return RULES.get(primitive, Rule.UNKNOWN)


def table_markdown() -> str:
    """The rules as a markdown table, one row per rule (docs/autocast.md quotes it)."""
    lines = ["| rule | what it does | primitives |", "| --- | --- | --- |"]
    for rule in Rule:
        names = sorted(n for n, r in RULES.items() if r is rule)
        shown = ", ".join(f"`{n}`" for n in names) or (
            "any other" if rule is Rule.UNKNOWN else "(a policy's choice)")
        lines.append(f"| {rule.value} | {DESCRIPTIONS[rule]} | {shown} |")
    return "\n".join(lines)
