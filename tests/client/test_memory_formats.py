"""Memory formats: results come out in the layout a CPU run gives them, with the same values.

A layout is more than cosmetics: convolution, group norm and pooling pick their kernel by the
input's memory format, and round differently in each. A channels-last net (or a batch of one,
whose size-1 batch dimension leaves strides ambiguous) that drifts into another layout than a
CPU run's stops matching it bit for bit a few layers later.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

A = torch.ops.aten


def _channels_last(shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


_LAYERS = {
    "reflection pad 2d": (lambda x: F.pad(x, (1, 2, 1, 2), mode="reflect"), 4),
    "replication pad 2d": (lambda x: F.pad(x, (1, 1, 2, 2), mode="replicate"), 4),
    "reflection pad 3d": (lambda x: F.pad(x, (1,) * 6, mode="reflect"), 5),
    "replication pad 3d": (lambda x: F.pad(x, (1,) * 6, mode="replicate"), 5),
    "pixel shuffle": (lambda x: F.pixel_shuffle(x, 2), 4),
    "pixel unshuffle": (lambda x: F.pixel_unshuffle(x, 2), 4),
    "channel shuffle": (lambda x: F.channel_shuffle(x, 2), 4),
    "roll along dims": (lambda x: torch.roll(x, (1, 2), (2, 3)), 4),
    "group norm": (lambda x: F.group_norm(x, 2, torch.ones(4, device=x.device), torch.zeros(4, device=x.device)), 4),
    "max unpool": (lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2), 4),
    # CPU makes these gradients (or results) contiguous where the meta kernels keep the layout
    "mse loss": (lambda x: F.mse_loss(x, torch.linspace(-1, 1, x.numel()).reshape(x.shape).to(x.device)), 4),
    "smooth l1 loss": (lambda x: F.smooth_l1_loss(x, torch.zeros(x.shape, device=x.device)), 4),
    "huber loss": (lambda x: F.huber_loss(x, torch.zeros(x.shape, device=x.device), delta=0.5), 4),
    "glu": (lambda x: F.glu(x, 1), 4),
    "log sigmoid": (lambda x: F.logsigmoid(x), 4),
}


@pytest.mark.parametrize("batch", [2, 1])
@pytest.mark.parametrize("name", sorted(_LAYERS))
def test_channels_last_layers_keep_cpu_layout_and_values_forward_and_backward(device, name, batch):
    layer, dims = _LAYERS[name]
    x = _channels_last((batch, 4, 6, 6) if dims == 4 else (batch, 4, 4, 4, 4))
    results = {}
    for where in ("cpu", device):
        leaf = x.to(where).detach().requires_grad_()
        y = layer(leaf)
        grad = torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).to(where) / y.numel()
        if y.dim() == dims:
            grad = grad.contiguous(memory_format=torch.channels_last if dims == 4 else torch.channels_last_3d)
        y.backward(grad)
        results[where] = (y.stride(), y.detach().cpu(), leaf.grad.stride(), leaf.grad.cpu())
    cpu, remote = results["cpu"], results[device]
    assert remote[0] == cpu[0], "forward layout"
    assert torch.equal(remote[1], cpu[1]), "forward values"
    assert remote[2] == cpu[2], "gradient layout"
    if name == "group norm":
        # autograd's formula hands group norm's backward contiguous copies on every device but
        # the CPU (CUDA's path, which a device follows), so it rounds as CUDA does
        torch.testing.assert_close(remote[3], cpu[3])
    else:
        assert torch.equal(remote[3], cpu[3]), "gradient values"


@pytest.mark.parametrize("op", ["replication_pad2d", "reflection_pad3d"])
def test_an_out_kernel_that_restrides_its_out_is_read_in_the_layout_the_client_declared(device, op):
    # the CPU kernels restride a same-sized out= tensor to the input's memory format; the
    # client reads the storage by the layout it sent, so the node must write that layout
    x = _channels_last((2, 3, 4, 5) if op.endswith("2d") else (2, 3, 4, 4, 4))
    padding = [1, 1, 2, 2] if op.endswith("2d") else [1] * 6
    expected = getattr(A, op)(x, padding)
    out = torch.empty(expected.shape, device=device)  # contiguous
    getattr(A, op).out(x.to(device), padding, out=out)
    assert torch.equal(out.cpu(), expected)
    assert torch.equal((out * 1).cpu(), expected)  # a later op reads it right too


_NUMBER_OPS = {
    "x * 2.0": lambda x: x * 2.0,
    "x / 3.0": lambda x: x / 3.0,
    "x + 1": lambda x: x + 1,
    "2.0 - x": lambda x: 2.0 - x,
    "x * 0-dim host tensor": lambda x: x * torch.tensor(2.0),
    "int x * 2.5": lambda x: x.int() * 2.5,
}


@pytest.mark.parametrize("name", sorted(_NUMBER_OPS))
def test_a_number_operand_keeps_cpu_strides_on_a_size_one_batch(device, name):
    # A batch-1 channels-last tensor whose batch stride is C, as attention blocks' reshapes
    # leave it (diffusers' UNet): TensorIterator keeps that stride for an op with a number,
    # the Python reference kernels did not, and the next group norm took another kernel.
    op = _NUMBER_OPS[name]
    x = torch.as_strided(_channels_last((1, 32, 8, 8)), (1, 32, 8, 8), (32, 1, 256, 32))
    expected = op(x)
    got = op(x.to(device))
    assert got.stride() == expected.stride()
    assert got.dtype == expected.dtype
    assert torch.equal(got.cpu(), expected)
    if expected.is_floating_point():
        assert torch.equal(F.group_norm(got, 8).cpu(), F.group_norm(expected, 8))


@pytest.mark.parametrize("batch", [1, 3])
def test_a_channels_last_super_resolution_net_trains_bit_for_bit(device, batch):
    def net():
        torch.manual_seed(1)
        return nn.Sequential(
            nn.ReflectionPad2d(1), nn.Conv2d(3, 8, 3), nn.SiLU(),
            nn.ReplicationPad2d(1), nn.Conv2d(8, 12, 3), nn.PixelShuffle(2), nn.Conv2d(3, 4, 3, padding=1),
            nn.ChannelShuffle(2), nn.PixelUnshuffle(2), nn.Conv2d(16, 3, 1),
        ).to(memory_format=torch.channels_last)

    torch.manual_seed(2)
    data = [(torch.randn(batch, 3, 8, 8).contiguous(memory_format=torch.channels_last), torch.randn(batch, 3, 8, 8))
            for _ in range(3)]
    runs = {}
    for where in ("cpu", device):
        model = net().to(where)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for x, target in data:
            opt.zero_grad()
            out = model(x.to(where))
            loss = F.mse_loss(out * 0.5, target.to(where))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs[where] = (losses, [p.detach().cpu() for p in model.parameters()])
    assert runs[device][0] == runs["cpu"][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[device][1], runs["cpu"][1]))


@pytest.mark.parametrize("name, op", [
    ("abs", torch.abs), ("logical_not", torch.logical_not), ("isinf", torch.isinf),
    ("logical_and", lambda x: torch.logical_and(x, x > 0)), ("complex", lambda x: torch.complex(x, x)),
    ("hardshrink", F.hardshrink),
])
def test_ops_that_fill_an_empty_out_keep_a_channels_last_layout(device, name, op):
    # their composite kernels pass ``empty(0)`` to the out= kernel, which TensorIterator
    # resizes *and restrides* to the result's layout; resized contiguous, a channels-last
    # net left channels-last at the first ``abs``
    x = _channels_last((2, 3, 4, 5))
    expected = op(x)
    got = op(x.to(device))
    assert got.stride() == expected.stride()
    assert torch.equal(got.cpu(), expected)


def test_a_user_out_tensor_of_the_wrong_size_is_resized_like_cpu(device):
    x = _channels_last((2, 3, 4, 5))
    expected, out = torch.empty(0), torch.empty(0, device=device)
    torch.abs(x, out=expected)
    torch.abs(x.to(device), out=out)
    assert out.stride() == expected.stride()
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("name, op", [
    ("zeros_like", torch.zeros_like), ("ones_like", torch.ones_like), ("full_like", lambda x: torch.full_like(x, 2.0)),
    ("randn_like", torch.randn_like), ("rand_like", torch.rand_like), ("randint_like", lambda x: torch.randint_like(x, 9)),
    ("empty_like", torch.empty_like), ("flip", lambda x: torch.flip(x, (2,))),
    ("relu6", F.relu6), ("hardtanh", F.hardtanh), ("prelu", lambda x: F.prelu(x, torch.tensor([0.25], device=x.device))),
    ("huber_loss, no reduction", lambda x: F.huber_loss(x, x * 0, reduction="none")),
    ("zeros_like, contiguous asked", lambda x: torch.zeros_like(x, memory_format=torch.contiguous_format)),
])
def test_like_factories_keep_a_dense_input_s_exact_strides(device, name, op):
    # ``empty_like`` keeps a dense input's strides, size-1 dimensions included: a batch-1
    # channels-last tensor whose batch stride is C is not "channels last" to PyTorch's memory
    # format test, and the next kernel must see the same layout as in a CPU run
    x = torch.as_strided(_channels_last((1, 32, 8, 8)), (1, 32, 8, 8), (32, 1, 256, 32))
    expected = op(x)
    got = op(x.to(device))
    assert got.stride() == expected.stride()
    if name not in ("randn_like", "rand_like", "randint_like", "empty_like"):
        assert torch.equal(got.cpu(), expected)


def _batch_norm_inputs():
    torch.manual_seed(3)
    one, two, five = torch.randn(1, 2, 3, 4), torch.randn(2, 3, 4, 5), torch.randn(1, 3, 4, 5, 2)
    channels_last = one.contiguous(memory_format=torch.channels_last)
    return {
        "batch 1 contiguous": one,
        "batch 1 channels-last": channels_last,
        "batch 1 channels-last, batch stride C": torch.as_strided(channels_last, one.shape, (2, 1, 8, 2)),
        "batch 1, odd batch stride": torch.as_strided(one.contiguous(), one.shape, (7, 12, 4, 1)),
        "one channel, channels-last": torch.randn(2, 1, 3, 4).contiguous(memory_format=torch.channels_last),
        "channels-last": two.contiguous(memory_format=torch.channels_last),
        "transposed": two.transpose(2, 3),
        "channels-last 3d": five.contiguous(memory_format=torch.channels_last_3d),
    }


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("layout", sorted(_batch_norm_inputs()))
def test_batch_norm_gives_cpu_s_layout_for_every_input_layout(device, layout, training):
    x = _batch_norm_inputs()[layout]
    channels = x.shape[1]
    results = {}
    for where in ("cpu", device):
        leaf = x.to(where).detach().requires_grad_()
        weight = torch.linspace(0.5, 1.5, channels).to(where).requires_grad_()
        y = F.batch_norm(leaf, torch.zeros(channels).to(where), torch.ones(channels).to(where), weight, None,
                         training=training)
        y.backward((torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape) / 7).to(where))
        results[where] = (y.stride(), y.detach().cpu(), leaf.grad.stride(), leaf.grad.cpu(), weight.grad.cpu())
    cpu, remote = results["cpu"], results[device]
    assert (remote[0], remote[2]) == (cpu[0], cpu[2])
    assert torch.equal(remote[1], cpu[1]) and torch.equal(remote[3], cpu[3]) and torch.equal(remote[4], cpu[4])


def test_a_cuda_nodes_convolution_is_declared_in_cudnns_layout():
    """On a CUDA node a convolution's result has cuDNN's layout: channels-last when the input or
    the weight is (float32/half/bfloat16, 2-d and 3-d, cuDNN enabled). The meta kernel answers
    contiguous whatever the layout; before, an H200 node's channels-last net went on contiguous
    (checked there by bench/gpu_check.py; here the client's rule on meta tensors)."""
    from gpuwire.client.device import _CUDA_KERNEL_FIXES
    conv, conv_backward = (_CUDA_KERNEL_FIXES[f"aten::{name}.default"] for name in ("convolution",
                                                                                    "convolution_backward"))
    cl, cl3 = torch.channels_last, torch.channels_last_3d

    def forward(x, w):
        args = (x, w, None, [1] * (w.dim() - 2), [0] * (w.dim() - 2), [1] * (w.dim() - 2), False,
                [0] * (w.dim() - 2), 1)
        out = torch.ops.aten.convolution.default(*args)
        assert out.is_contiguous()  # what the meta kernel says, whatever the layout
        return conv(args, {}, out)

    x, w = torch.empty(2, 3, 8, 8, device="meta"), torch.empty(4, 3, 3, 3, device="meta")
    assert forward(x, w).is_contiguous()
    assert forward(x.contiguous(memory_format=cl), w).is_contiguous(memory_format=cl)
    assert forward(x, w.contiguous(memory_format=cl)).is_contiguous(memory_format=cl)  # the weight decides too
    assert forward(x.double(), w.double().contiguous(memory_format=cl)).is_contiguous()  # no NHWC for double
    x3, w3 = torch.empty(2, 3, 6, 6, 6, device="meta"), torch.empty(4, 3, 3, 3, 3, device="meta")
    assert forward(x3.contiguous(memory_format=cl3), w3).is_contiguous(memory_format=cl3)
    with torch.backends.cudnn.flags(enabled=False):  # the native kernels keep contiguous results
        assert forward(x.contiguous(memory_format=cl), w).is_contiguous()

    x_cl = x.contiguous(memory_format=cl)
    args = (torch.empty(2, 4, 6, 6, device="meta"), x_cl, w, [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
            [True, True, True])
    grad_input, grad_weight, grad_bias = conv_backward(args, {}, torch.ops.aten.convolution_backward.default(*args))
    assert grad_input.is_contiguous(memory_format=cl) and grad_weight.is_contiguous(memory_format=cl)
    assert grad_bias.shape == (4,)


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 4), (4, 3, 2, 2)])
def test_nonzero_is_column_major_as_cpu_and_cuda_give_it(shape):
    """``nonzero``'s (n, ndim) result is laid out column-major by the CPU and CUDA kernels; the
    node copied it into a row-major one (its size depends on the data: the node's own result
    comes back, and a dense one now keeps its layout)."""
    torch.manual_seed(0)
    x = torch.randn(shape) > 0
    local = x.nonzero()
    remote = x.to("gpuwire").nonzero()
    assert remote.stride() == local.stride() and torch.equal(remote.cpu(), local)
    for a, b in zip(x.nonzero(as_tuple=True), x.to("gpuwire").nonzero(as_tuple=True)):
        assert torch.equal(b.cpu(), a)
