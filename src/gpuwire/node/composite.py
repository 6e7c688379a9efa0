"""Node-side halves of ops that the client sends whole with a recompute backward.

Sits beside ``node.ops`` (which resolves ``gpuwire::`` names to these functions). Some ATen
ops are composites whose path depends on the device type (LSTM/GRU pick oneDNN on CPU and a
CUDA-only fused cell on any other device; the client would otherwise take the wrong path).
The client sends the whole op; its forward runs here exactly as it would locally, and its
backward recomputes the forward under autograd here, with the random generator rewound to
where the forward started so dropout draws the same masks.
"""

from __future__ import annotations

import torch



def resolve_aten(name: str, device_type: str = "cpu"):
    from .ops import CPU_NODE_KERNELS, CUDA_NODE_KERNELS, OpRefused, _resolve  # ops imports this module

    from .guards import CHECKED_PER_SIGNATURE, guarded
    from .ops import _NodeKernel

    if not isinstance(name, str) or not name.startswith("aten::"):
        raise OpRefused(f"only aten ops can be recomputed, not {name!r}")
    op = _resolve(name, CUDA_NODE_KERNELS if device_type == "cuda" else CPU_NODE_KERNELS)
    check = CHECKED_PER_SIGNATURE.get(name[6:].partition(".")[0])
    # (an op run inside a composite never runs in the native loop: checked on every call)
    return op if check is None else _NodeKernel(op, guarded(op, check, op))


def _generator_for(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        torch.cuda.init()
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


def generator_state_on(device: torch.device) -> torch.Tensor:
    """The device generator's state now, as a tensor on ``device`` (kept for a recomputing
    backward). On CUDA it is written by kernels taking its words as arguments: a pageable
    host-to-device copy waits for the stream, so the node stopped running ahead of the GPU at
    every SDPA with dropout (an H100 timeline of GPT-2 small: a copy before each of the 12
    attention kernels, then 110-140 us of idle GPU while the node launched what followed), and a
    pinned copy allocates host memory each call (the host-bound bf16 step measured 84 ms with it
    against 60 without, on other hosts: suspected, not proven)."""
    state = _generator_for(device).get_state()
    if device.type == "cuda":
        return state_by_fills(state, device)
    return state.to(device)


def state_by_fills(state: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``state`` (bytes on the host) as a tensor on ``device`` made by ``fill_`` kernels, one a
    64-bit word (CUDA's Philox state: seed and offset, two), so no host memory is read by the
    device; ``state.to(device)`` where it is not whole words."""
    if state.numel() % 8 or state.numel() > 64:
        return state.to(device)
    words = torch.empty(state.numel() // 8, dtype=torch.int64, device=device)
    for i, value in enumerate(state.view(torch.int64).tolist()):
        words[i].fill_(value)
    return words.view(torch.uint8)


def tensor_leaves(value) -> list:
    """Tensor leaves of a value, depth first (how ``outs`` and recomputed gradients are ordered)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(tensor_leaves(v))
        return out
    return []


def _rebuild(value, replacements: iter):
    if isinstance(value, torch.Tensor):
        return next(replacements)
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, replacements) for v in value)
    return value


def forward_with_rng(name: str, *args, grad: bool = True, requires_grad=None):
    """Run op ``name``; also return the generator state from before it ran (for backward).
    ``grad``: the client's grad mode, ``requires_grad``: which of the tensor leaves of ``args``
    require grad on the client (kernels choose their path by both: oneDNN's RNNs run only with
    grad off or no parameter requiring it; a local training run takes ATen's own cells)."""
    leaves = tensor_leaves(args)
    device = next((t.device for t in leaves), torch.device("cpu"))
    op = resolve_aten(name, device.type)
    state = generator_state_on(device)
    if grad and isinstance(requires_grad, (list, tuple)) and len(requires_grad) == len(leaves) and any(requires_grad):
        args = _rebuild(args, iter([t.detach().requires_grad_(bool(wants) and (t.is_floating_point() or t.is_complex()))
                                    for t, wants in zip(leaves, requires_grad)]))
    with torch.set_grad_enabled(bool(grad)):
        result = op(*args)
    outs = [t.detach() if isinstance(t, torch.Tensor) else t
            for t in (result if isinstance(result, (tuple, list)) else [result])]
    return (*outs, state)


def backward_by_recompute(name: str, rng_state: torch.Tensor, grad_outputs: list, *args):
    """Gradients of op ``name`` w.r.t. every tensor in ``args`` (zeros where none flows)."""
    op = resolve_aten(name, rng_state.device.type)
    leaves = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in tensor_leaves(args)]
    rebuilt = _rebuild(args, iter(leaves))
    generator = _generator_for(rng_state.device)
    saved = generator.get_state()
    generator.set_state(rng_state.cpu())
    try:
        with torch.enable_grad():
            result = op(*rebuilt)
    finally:
        generator.set_state(saved)
    outs = list(result) if isinstance(result, (tuple, list)) else [result]
    pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
    wanted = [leaf for leaf in leaves if leaf.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True) \
        if pairs and wanted else [None] * len(wanted)
    by_leaf = dict(zip(map(id, wanted), grads))
    return tuple(by_leaf.get(id(leaf)) if by_leaf.get(id(leaf)) is not None else torch.zeros_like(leaf)
                 for leaf in leaves)


def generator_manual_seed(generator: torch.Generator, seed: int) -> None:
    generator.manual_seed(seed)


def generator_get_state(generator: torch.Generator) -> bytes:
    return bytes(generator.get_state().numpy().tobytes())


def generator_set_state(generator: torch.Generator, state: torch.Tensor) -> None:
    generator.set_state(state.cpu().contiguous())


COMPOSITE_OPS = {
    "gpuwire::generator_manual_seed": generator_manual_seed,
    "gpuwire::generator_get_state": generator_get_state,
    "gpuwire::generator_set_state": generator_set_state,
    "gpuwire::forward_with_rng": forward_with_rng,
    "gpuwire::backward_by_recompute": backward_by_recompute,
}
