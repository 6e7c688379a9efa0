"""Facts about ATen's kernels that the client and the node both act on.

Imported by the client's op paths (``client/device.py``) and the node's allocation guard
(``node/session.py``); nothing here crosses the wire.
"""

# out= kernels of the range factories resize their out only when its number of elements differs
# (``if (result.numel() != steps) result.resize_({steps})``, aten/native/RangeFactories.cpp):
# ``torch.linspace(0, 3, 4, out=x.narrow(1, 1, 2))`` writes its 4 values through the 2x2 view.
# Their meta kernels resize to the 1-d shape whatever the out's number of elements.
RESIZED_ONLY_BY_NUMEL = frozenset(
    [f"aten::{name}.{overload}" for name in ("linspace", "logspace")
     for overload in ("out", "Tensor_Tensor_out", "Tensor_Scalar_out", "Scalar_Tensor_out")]
    + ["aten::arange.out", "aten::arange.start_out", "aten::range.out", "aten::range.out_"])


def check_lu_unpack_pivots(lu_data, lu_pivots) -> None:
    """``lu_unpack``'s pivots must have ``LU_data``'s batch shape and ``min(m, n)`` entries: torch
    2.13's CPU kernel reads past a shorter pivots tensor and crashes the process (gh-177829;
    later torch raises this ValueError). On a node that is every tenant's session: the node
    checks it before the kernel, and the client at the call."""
    shape = getattr(lu_data, "shape", None)
    pivots = getattr(lu_pivots, "shape", None)
    if shape is None or pivots is None or len(shape) < 2:
        return  # (the kernel's own checks name what is wrong)
    expected = (*shape[:-2], min(shape[-2], shape[-1]))
    if tuple(pivots) != expected:
        raise ValueError(f"Expected LU_pivots to have shape {list(expected)} (LU_data's batch shape and "
                         f"min(m, n)), but got {list(pivots)}")
