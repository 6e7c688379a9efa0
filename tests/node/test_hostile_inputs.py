"""Arguments a kernel trusts, sent to a real node: it answers with an error and lives on.

Some ATen kernels read or write where an argument tells them (indices into another tensor,
offsets, the sizes of outputs they are handed) without checking it: internal ops whose usual
caller only passes what a forward produced. A client's bug or a hostile tenant crashed the node
process with them (SIGSEGV, SIGABRT, SIGFPE; a hang), ending every tenant's session, or read
other memory of the node (``_reshape_alias`` past its storage). ``node/guards.py`` checks them
first; a few op families are refused outright (``node/ops.py`` ``DENIED_ATEN_PREFIXES``).

Every hostile call here crashed or misread a torch 2.13 CPU node before session 38. The second
half runs the same ops as programs use them (forward and backward, compared with a local CPU
run bit for bit), so the checks refuse nothing a program sends.
"""

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import NodeProcess

HOSTILE = textwrap.dedent("""
    import sys, torch, gpuwire
    gpuwire.attach(sys.argv[1])
    D, L, BIG = "gpuwire", torch.long, 1 << 40
    aten = torch.ops.aten
    T = lambda v, dtype=None: torch.tensor(v, device=D, dtype=dtype)
    R = lambda *s: torch.randn(*s, device=D)

    def raw(name, *args):  # (sent as is: the client checks some of these itself, or crashes in its own inference)
        from gpuwire.client.device import runtime, _from_result
        rt = runtime()
        with rt.lock:
            return _from_result(rt, rt.call_sync(name, list(args), {}))

    cases = {
        "max_pool2d backward, index past the plane": lambda: aten.max_pool2d_with_indices_backward(
            R(1, 1, 2, 2), R(1, 1, 4, 4), [2, 2], [2, 2], [0, 0], [1, 1], False, torch.full((1, 1, 2, 2), BIG, device=D)),
        "max_pool3d backward, index past the volume": lambda: aten.max_pool3d_with_indices_backward(
            R(1, 1, 1, 2, 2), R(1, 1, 2, 4, 4), [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False,
            torch.full((1, 1, 1, 2, 2), BIG, device=D)),
        "adaptive_max_pool2d backward, index past the plane": lambda: aten.adaptive_max_pool2d_backward(
            R(1, 1, 2, 2), R(1, 1, 4, 4), torch.full((1, 1, 2, 2), BIG, device=D)),
        "embedding backward by frequency, index past the table": lambda: aten.embedding_dense_backward(
            R(2, 3), T([0, BIG]), 4, -1, True),
        "embedding_bag backward, offset2bag past the bags": lambda: aten._embedding_bag_backward(
            R(2, 3), T([0, 1, 2]), T([0, 1]), T([0, BIG, 1]), T([2, 1]), T([0, 0]), 4, False, 0, False, None, -1),
        "embedding_bag per-sample-weights backward, index past the table": lambda:
            aten._embedding_bag_per_sample_weights_backward(R(2, 3), R(4, 3), T([0, BIG, 2]), T([0, 1]),
                                                            T([0, 0, 1]), 0, -1),
        "ctc_loss, target class past the classes": lambda: torch.nn.functional.ctc_loss(
            torch.log_softmax(R(5, 2, 4), 2), T([[1, BIG], [1, 2]]), [5, 5], [2, 2]),
        "ctc_loss backward, log_alpha too small": lambda: aten._ctc_loss_backward(
            torch.ones(2, device=D), torch.log_softmax(R(5, 2, 4), 2), T([[1, 2], [1, 2]]), [5, 5], [2, 2],
            torch.zeros(2, device=D), torch.zeros(1, 1, 1, device=D), 0),
        "segment_reduce, offsets past the data": lambda: aten.segment_reduce(R(4), "max", offsets=T([0, 2, BIG])),
        "segment_reduce backward, lengths past the data": lambda: aten._segment_reduce_backward(
            R(2), R(2), R(4), "max", lengths=T([2, 100])),
        "fused Adam, a gradient smaller than its parameter": lambda: aten._fused_adam_(
            [R(400)], [R(4)], [R(4)], [R(4)], [], [T(1.)], lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.,
            eps=1e-8, amsgrad=False, maximize=False),
        "batch norm, running stats of one channel for eight": lambda: aten.native_batch_norm(
            R(2, 8, 3), None, None, torch.zeros(1, device=D), torch.ones(1, device=D), True, 0.1, 1e-5),
        "batch_norm_update_stats, running stats too short": lambda: aten.batch_norm_update_stats(
            R(2, 8, 3), torch.zeros(1, device=D), torch.ones(1, device=D), 0.1),
        "eigvals of NaNs": lambda: torch.linalg.eigvals(torch.full((6, 6), float("nan"), device=D)),
        "eigvals of infs, complex": lambda: torch.linalg.eigvals(
            torch.full((4, 4), float("inf"), device=D, dtype=torch.complex64)),
        "COO to CSR, a negative row": lambda: aten._convert_indices_from_coo_to_csr(T([-BIG, 1, 2]), 3),
        "COO to CSR, a row past the size (hung)": lambda: aten._convert_indices_from_coo_to_csr(T([0, BIG, 5]), 3),
        "CSR to COO, decreasing rows": lambda: aten._convert_indices_from_csr_to_coo(T([0, 5, -BIG, 2]), T([0, 1])),
        "cummax helper, outputs too small": lambda: aten._cummax_helper(
            R(1000), torch.empty(1, device=D), torch.empty(1, dtype=L, device=D), 0),
        "lstm, weights for another hidden size": lambda: aten.lstm.input(
            R(3, 2, 4), (torch.zeros(1, 2, 4, device=D),) * 2, [R(1, 1), R(1, 1), R(1), R(1)], True, 1, 0.0,
            False, False, True),
        "pad_packed_sequence, negative batch sizes": lambda: raw(
            "aten::_pad_packed_sequence", R(5, 4), T([3, -2]), False, 0.0, 3),
        "integer division of the minimum by -1 (SIGFPE)": lambda: [  # (again: the native loop must not learn it)
            torch.div(T([-(1 << 63), 7]), T([-1, 2]), rounding_mode="trunc") for _ in range(3)][-1],
        "_reshape_alias past its storage (read other memory)": lambda: raw(
            "aten::_reshape_alias", torch.arange(4., device=D), [1000], [1]),
        "cdist backward, grad of another shape": lambda: aten._cdist_backward(
            R(2, 2), R(2, 3), R(4, 3), 2., R(1, 1)),
        "pdist backward, grad too short": lambda: aten._pdist_backward(R(1), R(4, 3), 2., R(1)),
        "linear combination, coefficients of another width": lambda: aten._compute_linear_combination(
            R(4, 3), R(100, 100)),
        "rfft over a dimension the input lacks": lambda: aten._fft_r2c(R(4, 3), [5], 0, True),
        "attention's qkv bias too short": lambda: aten._transform_bias_rescale_qkv(R(2, 4, 24), R(3), 2),
        "weight norm backward, norms too short": lambda: aten._weight_norm_interface_backward(
            R(4, 3), R(4, 3), R(1), R(1), 0),
        "embedding_bag with decreasing offsets (read other memory)": lambda: torch.nn.functional.embedding_bag(
            T([0, 1, 2, 3]), R(4, 3), T([0, 3, 1])),
        "grid sampler's CPU fallback with a NaN grid": lambda: raw(
            "aten::_grid_sampler_2d_cpu_fallback", R(1, 1, 4, 4), torch.full((1, 2, 2, 2), float("nan"), device=D),
            0, 0, False),
        "fbgemm packed weights (a raw pointer)": lambda: raw("aten::fbgemm_pack_gemm_matrix_fp16", R(8, 8)),
        "Sobol engine draw": lambda: raw("aten::_sobol_engine_draw", torch.zeros(4, 1000, device=D), 4, T([0]), 1000,
                                         0, torch.float32),
    }
    for name, case in cases.items():
        try:
            result = case()
            torch.gpuwire.synchronize()
            print(f"{name} | no error: {result if isinstance(result, torch.Tensor) else type(result).__name__}",
                  flush=True)
        except gpuwire.ConnectionLost as exc:
            print(f"{name} | NODE LOST: {exc}", flush=True)
            break
        except Exception as exc:
            print(f"{name} | {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
    print("alive", (torch.ones(3, device=D) * 2).sum().item(), flush=True)
""")

# what each call must raise (the node's words, or the refusal); the integer division has the
# result a GPU gives (two's complement wraps to the minimum), which local CPU's floor rounding gives too
EXPECTED = {
    "max_pool2d backward, index past the plane": "indices holds 1099511627776, out of range [-1, 16)",
    "max_pool3d backward, index past the volume": "indices holds 1099511627776, out of range [-1, 32)",
    "adaptive_max_pool2d backward, index past the plane": "indices holds 1099511627776, out of range [-1, 16)",
    "embedding backward by frequency, index past the table": "indices holds 1099511627776, out of range [0, 4)",
    "embedding_bag backward, offset2bag past the bags": "offset2bag holds 1099511627776, out of range [0, 2)",
    "embedding_bag per-sample-weights backward, index past the table": "out of range [0, 4)",
    "ctc_loss, target class past the classes": "targets holds 1099511627776, out of range [0, 4)",
    "ctc_loss backward, log_alpha too small": "expected log_alpha of shape [2, 5, 5]",
    "segment_reduce, offsets past the data": "offsets must not decrease and must stay within [0, 4]",
    "segment_reduce backward, lengths past the data": "lengths must be non-negative and add up to at most 4",
    "fused Adam, a gradient smaller than its parameter": "grads[0] has shape [4], its parameter [400]",
    "batch norm, running stats of one channel for eight": "expected running_mean to have 8 elements",
    "batch_norm_update_stats, running stats too short": "expected running_mean to have 8 elements",
    "eigvals of NaNs": "torch.linalg.eigvals: input tensor should not contain infs or NaNs",
    "eigvals of infs, complex": "torch.linalg.eigvals: input tensor should not contain infs or NaNs",
    "COO to CSR, a negative row": "the row indices holds -1099511627776, out of range [0, 3)",
    "COO to CSR, a row past the size (hung)": "the row indices holds 1099511627776, out of range [0, 3)",
    "CSR to COO, decreasing rows": "crow_indices must not decrease",
    "cummax helper, outputs too small": "expected values of shape [1000], but got [1]",
    "lstm, weights for another hidden size": "layer 0's weights must be [16, 4] and [16, 4]",
    "pad_packed_sequence, negative batch sizes": "batch_sizes must be positive",
    "integer division of the minimum by -1 (SIGFPE)": "no error: tensor([-9223372036854775808,                    3]",
    "_reshape_alias past its storage (read other memory)": "reaches element 999, past the storage's 4",
    "cdist backward, grad of another shape": "expected grad of shape [2, 4], but got [2, 2]",
    "pdist backward, grad too short": "expected grad to have 6 elements, but got 1",
    "linear combination, coefficients of another width": "expected coefficients of shape (m, 4)",
    "rfft over a dimension the input lacks": "dims [5] must be distinct dimensions of a 2-d input",
    "attention's qkv bias too short": "expected qkv_bias to have 24 elements, but got 3",
    "weight norm backward, norms too short": "expected saved_g to have 4 elements, but got 1",
    "embedding_bag with decreasing offsets (read other memory)": "offsets must not decrease",
    "grid sampler's CPU fallback with a NaN grid": "is refused",
    "fbgemm packed weights (a raw pointer)": "is refused",
    "Sobol engine draw": "is refused",
}


@pytest.fixture(scope="module")
def own_node():
    node = NodeProcess()  # (its own: should a check be missing, the crash ends this node only)
    yield node
    node.kill()


def test_hostile_arguments_get_an_error_and_the_node_lives_on(own_node):
    run = subprocess.run([sys.executable, "-c", HOSTILE, own_node.address], capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    said = dict(line.split(" | ", 1) for line in run.stdout.splitlines() if " | " in line)
    wrong = {name: said.get(name, "(never ran)") for name, words in EXPECTED.items()
             if words not in said.get(name, "")}
    assert not wrong, "\n".join(f"{name}: {got}" for name, got in wrong.items()) + "\n" + own_node.log_text()[-3000:]
    assert "alive 6.0" in run.stdout, run.stdout[-2000:]
    assert own_node.proc.poll() is None, own_node.log_text()[-3000:]


LEGIT = textwrap.dedent("""
    import sys, torch, gpuwire
    import torch.nn.functional as F
    gpuwire.attach(sys.argv[1])
    # (both sides on torch's default threads, as a node runs: reductions split by threads)

    def both(program):
        '''program(device) -> tensors; run on CPU and on the node from the same seed, compared bit for bit'''
        results = []
        for device in ("cpu", "gpuwire"):
            torch.manual_seed(0)
            results.append([t.detach().cpu() for t in program(device)])
        return all(torch.equal(a, b) for a, b in zip(*results)) and len(results[0]) == len(results[1])

    def with_grad(device, *shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype).to(device).requires_grad_()

    def pooled(device):
        x = with_grad(device, 2, 3, 8, 8)
        y = F.max_pool2d(x, 2) + F.adaptive_max_pool2d(x, 3).sum() + F.max_pool3d(x.unsqueeze(1), 2).sum()
        y.sum().backward()
        return [y, x.grad]

    def embedded(device):
        weight = with_grad(device, 10, 4)
        index = torch.tensor([[1, 2, 2, 9], [0, 0, 5, 3]]).to(device)
        out = F.embedding(index, weight, padding_idx=0, scale_grad_by_freq=True).sum() \\
            + F.embedding(index, weight).pow(2).sum()
        bag = F.embedding_bag(index.flatten(), weight, torch.tensor([0, 3, 5]).to(device), mode="max").sum() \\
            + F.embedding_bag(index, weight, mode="mean").sum() \\
            + F.embedding_bag(index.flatten(), weight, torch.tensor([0, 2]).to(device), mode="sum",
                              per_sample_weights=torch.rand(8).to(device)).sum()
        (out + bag).backward()
        return [out, bag, weight.grad]

    def ctc(device):
        log_probs = with_grad(device, 12, 2, 5)
        # (padding past each target's length may hold anything: -1 here)
        targets = torch.tensor([[1, 2, 3, -1, -1], [2, 4, -1, -1, -1]]).to(device)
        loss = F.ctc_loss(log_probs.log_softmax(2), targets, [12, 10], [3, 2])
        flat = F.ctc_loss(log_probs.log_softmax(2), torch.tensor([1, 2, 3, 2, 4]).to(device), [12, 10], [3, 2])
        (loss + flat).backward()
        return [loss, flat, log_probs.grad]

    def normalized(device):
        bn = torch.nn.BatchNorm2d(3).to(device)
        x = with_grad(device, 4, 3, 5, 5)
        y = bn(x)
        y.pow(2).sum().backward()
        bn.eval()  # (frozen statistics, as in fine-tuning: the backward's saved statistics are empty)
        frozen = with_grad(device, 4, 3, 5, 5)
        z = bn(frozen)
        z.pow(2).sum().backward()
        return [y, x.grad, z, frozen.grad, bn.weight.grad, bn.running_mean, bn.running_var]

    def distances(device):
        a, b = with_grad(device, 5, 3), with_grad(device, 4, 3)
        batched, broadcast = with_grad(device, 2, 5, 3), with_grad(device, 1, 4, 3)
        y = torch.cdist(a, b).sum() + F.pdist(a).sum() + torch.cdist(batched, broadcast).sum()
        y.backward()
        return [y, a.grad, b.grad, batched.grad, broadcast.grad]

    def exponentiated(device):
        m = with_grad(device, 2, 3, 3)
        y = torch.linalg.matrix_exp(m * 0.3)
        y.sum().backward()
        return [y, m.grad]

    def recurrent(device):
        results = []
        for cell in (torch.nn.LSTM(4, 6, num_layers=2, bidirectional=True), torch.nn.GRU(4, 6, bias=False),
                     torch.nn.LSTM(4, 6, proj_size=3), torch.nn.RNN(4, 6, batch_first=True)):
            cell = cell.to(device)
            x = with_grad(device, 5, 3, 4)
            packed = torch.nn.utils.rnn.pack_padded_sequence(x, [5, 4, 2], enforce_sorted=True)
            out, _ = cell(packed)
            padded, lengths = torch.nn.utils.rnn.pad_packed_sequence(out)
            direct, _ = cell(x)
            (padded.sum() + direct.sum()).backward()
            results += [padded, direct, x.grad, lengths]
        return results

    def optimized(device):
        results = []
        for make in (lambda p: torch.optim.Adam(p, lr=0.1, fused=True), lambda p: torch.optim.AdamW(p, fused=True),
                     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
                     lambda p: torch.optim.Adagrad(p, fused=True)):
            params = [with_grad(device, 5, 3), with_grad(device, 7)]
            optimizer = make(params)
            for _ in range(2):
                optimizer.zero_grad()
                sum((p * p).sum() for p in params).backward()
                optimizer.step()
            results += params
        return results

    def spectral(device):
        x = with_grad(device, 4, 6)
        y = torch.fft.irfft(torch.fft.rfft(x), n=6).sum() + torch.fft.fft2(x).abs().sum()
        y.backward()
        return [y, x.grad]

    def segmented(device):
        data = with_grad(device, 6, 2)
        y = torch.segment_reduce(data, "max", lengths=torch.tensor([1, 2, 3]).to(device)).sum() \\
            + torch.segment_reduce(data, "sum", offsets=torch.tensor([0, 4, 6]).to(device)).sum()
        y.backward()
        return [y, data.grad]

    def cumulative(device):
        x = with_grad(device, 4, 5)
        y = torch.cummax(x, 1).values.sum() + torch.cummin(x, 0).values.sum()
        y.backward()
        return [y, x.grad]

    def weight_normed(device):
        layer = torch.nn.utils.weight_norm(torch.nn.Linear(3, 4)).to(device)
        y = layer(with_grad(device, 2, 3)).sum()
        y.backward()
        return [y, layer.weight_g.grad, layer.weight_v.grad]

    def attention_fast_path(device):
        layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True).to(device).eval()
        with torch.no_grad():
            return [layer(torch.randn(2, 5, 8).to(device))]

    def views(device):
        x = torch.arange(24.0).to(device)
        return [x.view(4, 6).t().reshape(24), x[2:].reshape(2, 11), x.view(2, 3, 4).transpose(0, 2).reshape(-1, 2)]

    def divided(device):
        a, b = torch.tensor([-7, 7, 9, -(1 << 62)]).to(device), torch.tensor([2, -1, -3, -1]).to(device)
        return [torch.div(a, b, rounding_mode="trunc"), torch.div(a, -1, rounding_mode="trunc"), a // b]

    def eigen(device):
        return [torch.linalg.eigvals(torch.tensor([[2.0, 1.0], [1.0, 3.0]]).to(device))]

    for name, program in list(globals().items()):
        if callable(program) and name not in ("both", "with_grad", "F") and not name.startswith("_") \\
                and getattr(program, "__module__", None) == "__main__":
            print(name, both(program), flush=True)
""")

LEGIT_PROGRAMS = ("pooled", "embedded", "ctc", "normalized", "distances", "exponentiated", "recurrent", "optimized",
                  "spectral", "segmented", "cumulative", "weight_normed", "attention_fast_path", "views", "divided",
                  "eigen")


def test_the_checked_ops_as_programs_use_them_equal_a_local_cpu_run(own_node):
    run = subprocess.run([sys.executable, "-c", LEGIT, own_node.address], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for name in LEGIT_PROGRAMS:
        assert f"{name} True" in lines, (name, lines, run.stderr[-2000:])


def test_a_kernel_result_reaching_past_its_storage_is_never_copied():
    """Behind the guards: whatever view op a check misses, the node copies or keeps a kernel's
    result only inside its storage (``_reshape_alias`` unchecked made the copy read other memory)."""
    import torch

    from gpuwire.node.session import SessionError, _check_inside_storage
    values = torch.arange(8.0)
    for past_the_end in (torch.ops.aten._reshape_alias(values, [1000], [1]),
                         torch.ops.aten._reshape_alias(values[6:], [4], [1])):
        with pytest.raises(SessionError, match="reaching outside its storage of 32 bytes"):
            _check_inside_storage(past_the_end)
    for inside in (values[2:].view(2, 3), values.flip(0), values.expand(2, 8), values[8:]):
        _check_inside_storage(inside)
