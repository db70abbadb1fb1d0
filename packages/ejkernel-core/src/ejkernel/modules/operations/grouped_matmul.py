"""``grouped_matmul``: mixture-of-experts matmul over consecutive row groups.

Core validates the public call into one frozen :class:`GroupedMatmulCall`; that object is all a backend
sees:

- ``lhs`` ``[M, K]``; ``rhs`` ``[G, K, N]`` (``[G, N, K]`` when ``transpose_rhs``), same dtype;
  ``group_sizes`` int32 ``[G_total]`` with ``G_total >= G`` and ``sum(group_sizes) <= M``.
- Group ``g`` owns rows ``start[g] <= m < start[g] + group_sizes[g]`` with ``start[g] = sum(group_sizes[:g])``.
  This call computes groups ``group_offset <= g < group_offset + G`` (``group_offset`` int32 ``[1]`` or
  None meaning 0, in which case ``G_total == G``): ``out[m] = lhs[m] @ W[g - group_offset]`` with
  ``W[j] = rhs[j]`` (or ``rhs[j].T``). Every other row is ``existing_out[m]`` when given, else 0.
- Accumulation in float32 at ``precision`` (None resolves to HIGHEST for float32 inputs, see
  ``_precision``); output dtype ``preferred_element_type`` (None resolves to float32, as in the
  original library).

Gradients: ``lhs``, ``rhs`` and ``existing_out``; none for the integer inputs. Full specification:
``docs/ops/grouped_matmul.md``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int

from ejkernel.modules.operations._base import Arguments, RegistryOperation, execute, public_function
from ejkernel.modules.operations._contract import array_field, canonical_call
from ejkernel.modules.operations._precision import resolve_precision
from ejkernel.modules.operations._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_array,
    check_bool,
    check_dim,
    check_same_dtype,
    concrete,
    describe,
)


@canonical_call
class GroupedMatmulCall:
    """A validated ``grouped_matmul`` call (see the module docstring)."""

    lhs: Float[jax.Array, "m k"] = array_field()
    rhs: Float[jax.Array, "num_groups k n"] | Float[jax.Array, "num_groups n k"] = array_field()
    """``[num_groups, n, k]`` exactly when ``transpose_rhs``."""
    group_sizes: Int[jax.Array, "total_groups"] = array_field()
    """int32 rows per group; ``total_groups == num_groups`` unless ``group_offset`` is given."""
    group_offset: Int[jax.Array, "1"] | None = array_field()
    """int32 ``[1]``: the first group computed here (None: 0)."""
    existing_out: Float[jax.Array, "m n"] | None = array_field()
    """Rows kept where no computed group owns the row, in ``preferred_element_type``."""
    preferred_element_type: np.dtype = np.dtype(np.float32)
    """The output dtype (float32, bfloat16 or float16)."""
    transpose_rhs: bool = False
    precision: jax.lax.Precision = jax.lax.Precision.DEFAULT
    """Matmul precision floor (``_precision``): HIGHEST for float32 inputs unless the caller asked otherwise."""


class GroupedMatmul(RegistryOperation):
    """Grouped (MoE) matmul (see the module docstring)."""

    algorithm = "grouped_matmul"

    def canonicalize(self, args: Arguments) -> GroupedMatmulCall:
        lhs, rhs, group_sizes, group_offset, existing_out = (
            args.lhs, args.rhs, args.group_sizes, args.group_offset, args.existing_out
        )
        transpose_rhs = check_bool("transpose_rhs", args.transpose_rhs)
        preferred_element_type = args.preferred_element_type
        check_array("lhs", lhs, rank=2, dtypes=FLOAT_DTYPES, what="[m, k]")
        rhs_layout = "[num_groups, n, k] (transpose_rhs=True)" if transpose_rhs else "[num_groups, k, n]"
        check_array("rhs", rhs, rank=3, dtypes=FLOAT_DTYPES, what=rhs_layout)
        check_same_dtype("lhs", lhs, rhs=rhs)
        m, k = lhs.shape
        contracting_axis, n = (2, rhs.shape[1]) if transpose_rhs else (1, rhs.shape[2])
        check_dim("rhs", rhs, contracting_axis, k, f"k of lhs, layout {rhs_layout}")
        num_groups = rhs.shape[0]
        check_array("group_sizes", group_sizes, rank=1, dtypes=INT_DTYPES, what="[num_groups] row counts")
        total_groups = group_sizes.shape[0]
        if group_offset is None:
            if total_groups != num_groups:
                raise ValueError(
                    f"group_sizes has {total_groups} groups but rhs holds {num_groups} ({describe(rhs)}); pass "
                    "group_offset to compute a slice of the groups, or make them equal"
                )
        else:
            if isinstance(group_offset, (int, np.integer)) and not isinstance(group_offset, bool):
                group_offset = jnp.asarray([group_offset], jnp.int32)
            check_array("group_offset", group_offset, dtypes=INT_DTYPES, what="(int32 scalar or [1])")
            if group_offset.size != 1:
                raise ValueError(f"group_offset must hold one index, got {describe(group_offset)}")
            group_offset = jnp.reshape(group_offset, (1,)).astype(jnp.int32)
            if total_groups < num_groups:
                raise ValueError(
                    f"group_sizes has {total_groups} groups, fewer than the {num_groups} of rhs ({describe(rhs)})"
                )
        sizes = concrete(group_sizes)
        if sizes is not None and ((sizes < 0).any() or sizes.sum() > m):
            raise ValueError(f"group_sizes must be >= 0 and sum to at most m={m} (rows of lhs), got {sizes.tolist()}")
        offset = None if group_offset is None else concrete(group_offset)
        if offset is not None and not 0 <= int(offset[0]) <= total_groups - num_groups:
            raise ValueError(
                f"group_offset must be in [0, {total_groups - num_groups}] (groups {total_groups}, rhs holds "
                f"{num_groups}), got {int(offset[0])}"
            )
        try:
            out_dtype = jnp.dtype(jnp.float32 if preferred_element_type is None else preferred_element_type)
        except TypeError:
            out_dtype = None
        if out_dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
            raise ValueError(
                f"preferred_element_type must be None or one of float32/bfloat16/float16, got {preferred_element_type!r}"
            )
        if existing_out is not None:
            check_array("existing_out", existing_out, rank=2, dtypes=[out_dtype], what=f"[m, n] of {out_dtype.name}")
            if existing_out.shape != (m, n):
                raise ValueError(f"existing_out must have shape [{m}, {n}] (m of lhs, n of rhs), got {describe(existing_out)}")
        return args.build(
            GroupedMatmulCall,
            group_sizes=group_sizes.astype(jnp.int32),
            group_offset=group_offset,
            preferred_element_type=out_dtype,
            transpose_rhs=transpose_rhs,
            precision=resolve_precision(args.precision, lhs.dtype),
        )


@public_function(GroupedMatmul)
def grouped_matmul(
    lhs: Float[jax.Array, "m k"],
    rhs: Float[jax.Array, "num_groups _ _"],
    group_sizes: Int[jax.Array, "total_groups"],
    group_offset: Int[jax.Array, "..."] | int | None = None,
    existing_out: Float[jax.Array, "m n"] | None = None,
    *,
    preferred_element_type: Any = None,
    transpose_rhs: bool = False,
    precision: str | jax.lax.Precision | None = None,
    platform: str = "auto",
    cfg: Any = None,
) -> Float[jax.Array, "m n"]:
    """Multiply consecutive row groups of ``lhs`` by their own matrix of ``rhs`` (MoE experts).

    Args:
        lhs: ``[m, k]``, rows sorted by group.
        rhs: ``[num_groups, k, n]``, or ``[num_groups, n, k]`` with ``transpose_rhs=True``.
        group_sizes: int ``[total_groups]``, rows per group, summing to at most ``m``.
        group_offset: first group computed here (expert sharding: ``rhs`` holds groups
            ``group_offset .. group_offset + num_groups - 1``); None means 0.
        existing_out: ``[m, n]`` rows kept for every row not computed here (default zeros).
        preferred_element_type: output dtype (default float32).
        transpose_rhs: ``rhs`` is stored ``[num_groups, n, k]``.
        precision: matmul precision floor (``None``: ``"highest"`` for float32 inputs); ``"default"``
            allows TF32 on NVIDIA GPUs (bf16 passes on TPUs).
        platform: ``"auto"`` or a platform name.
        cfg: one implementation's config (e.g. ``ejkernel_pallas.grouped_matmul.PallasGroupedMatmulConfig``);
            it selects that implementation. None: cached, tuned or heuristic config of the chosen one.

    Returns:
        ``[m, n]`` in ``preferred_element_type``. Full semantics: ``docs/ops/grouped_matmul.md``.
    """
    return execute(GroupedMatmul(), **locals())
