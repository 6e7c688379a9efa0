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
