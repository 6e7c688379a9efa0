"""Training runs through a real node, compared with the same runs on local CPU, bit for bit."""

import pytest
import torch
import torch.nn.functional as F

import gpuwire

from .models import LSTMLanguageModel, SmallResNet, mlp, tiny_gpt2, tiny_llama, train_classifier


def optimizer_step(opt, loss) -> float:
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def host_state(model) -> dict:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def assert_states_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"parameters differ from the CPU run: {different}"


def test_resnet_cnn_20_sgd_steps_bit_for_bit(device):
    cpu_losses, cpu_state = train_classifier(SmallResNet, "cpu", 20, "sgd")
    losses, state = train_classifier(SmallResNet, device, 20, "sgd")
    assert losses == cpu_losses
    assert_states_equal(state, cpu_state)
    assert losses[-1] < losses[0]


def test_mlp_100_adamw_steps_bit_for_bit(device):
    cpu_losses, cpu_state = train_classifier(mlp, "cpu", 100, "adamw", batch=(16, 784))
    losses, state = train_classifier(mlp, device, 100, "adamw", batch=(16, 784))
    assert losses == cpu_losses
    assert_states_equal(state, cpu_state)


def test_cnn_step_costs_exactly_one_round_trip(device):
    torch.manual_seed(0)
    model = SmallResNet().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(8, 3, 16, 16).to(device)
    y = torch.randint(0, 10, (8,)).to(device)

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    step()
    step()  # warm-up: the metadata cache is filled
    before = gpuwire.stats()["round_trips"]
    for _ in range(5):
        step()
    assert gpuwire.stats()["round_trips"] - before == 5


def _lm_step(model, opt, ids):
    out = model(input_ids=ids, labels=ids)
    opt.zero_grad()
    out.loss.backward()
    opt.step()
    return out.loss.item()


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_hugging_face_causal_lm(device, build, tmp_path):
    def run(dev):
        torch.manual_seed(0)
        model = build().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(1)
        losses = [_lm_step(model, opt, torch.randint(0, 256, (2, 16), generator=data).to(dev)) for _ in range(3)]
        model.eval()
        prompt = torch.tensor([[5, 17, 42, 7]]).to(dev)
        tokens = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
        return model, losses, tokens.cpu(), {k: v.detach().cpu() for k, v in model.state_dict().items()}

    _, cpu_losses, cpu_tokens, cpu_state = run("cpu")
    model, losses, tokens, state = run(device)
    assert losses == cpu_losses
    assert torch.equal(tokens, cpu_tokens)
    assert_states_equal(state, cpu_state)

    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).to(device)
    assert_states_equal({k: v.cpu() for k, v in reloaded.state_dict().items()}, state)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_recurrent_language_model_step(device, cell):
    def run(dev):
        torch.manual_seed(0)
        model = LSTMLanguageModel(cell=cell).to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(2)).to(dev)
        losses = []
        for _ in range(3):
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 50), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}

    cpu_losses, cpu_state = run("cpu")
    losses, state = run(device)
    assert losses == cpu_losses
    assert_states_equal(state, cpu_state)


def test_state_dict_save_and_load_to_device(device, tmp_path):
    torch.manual_seed(0)
    model = SmallResNet().to(device)
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    loaded = torch.load(path, map_location="gpuwire")
    assert all(v.device.type == "gpuwire" for v in loaded.values())
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    assert_states_equal({k: v.cpu() for k, v in loaded.items()}, expected)
    cpu_loaded = torch.load(path, map_location="cpu")
    assert_states_equal(cpu_loaded, expected)


def test_packed_sequence_bidirectional_lstm(device):
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    def run(dev):
        torch.manual_seed(0)
        lstm = torch.nn.LSTM(4, 8, num_layers=2, bidirectional=True).to(dev)
        x = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1)).to(dev).requires_grad_()
        out, (h, c) = lstm(pack_padded_sequence(x, torch.tensor([5, 3, 2])))
        y, _ = pad_packed_sequence(out)
        (y.sum() + h.sum()).backward()
        return [y.detach().cpu(), x.grad.cpu(), lstm.weight_ih_l0.grad.cpu(), c.detach().cpu()]

    assert all(torch.equal(a, b) for a, b in zip(run("cpu"), run(device)))


@pytest.mark.parametrize("layer", ["RNN", "GRU", "LSTM"])
def test_batch_first_recurrent_layers_train_bit_for_bit(device, layer):
    """A batch-first GRU or RNN in training differed from a local run in the last bit: the node
    ran the layer with no parameter requiring grad, where ATen's CPU RNNs take oneDNN's kernels
    (a local training run takes ATen's own cells). The node now sees which inputs require grad."""
    def run(dev):
        torch.manual_seed(0)
        rnn = getattr(torch.nn, layer)(4, 6, num_layers=2, batch_first=True).to(dev)
        x = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1)).to(dev).requires_grad_()
        y, _ = rnn(x)
        y.pow(2).sum().backward()
        return [y.detach().cpu(), x.grad.cpu(), rnn.weight_hh_l1.grad.cpu()]

    assert all(torch.equal(a, b) for a, b in zip(run("cpu"), run(device)))


def _hf_model(name):
    from transformers import (BertConfig, BertForSequenceClassification, DistilBertConfig, DistilBertForMaskedLM,
                              GPTNeoXConfig, GPTNeoXForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, ViTConfig, ViTForImageClassification)
    small = dict(num_hidden_layers=2, intermediate_size=128)
    if name == "bert":
        return BertForSequenceClassification(BertConfig(hidden_size=64, num_attention_heads=2, vocab_size=256,
                                                        hidden_dropout_prob=0, attention_probs_dropout_prob=0,
                                                        num_labels=3, **small)), "classify"
    if name == "distilbert":
        return DistilBertForMaskedLM(DistilBertConfig(dim=64, hidden_dim=128, n_layers=2, n_heads=2, vocab_size=256,
                                                      dropout=0, attention_dropout=0)), "lm"
    if name == "mistral":
        return MistralForCausalLM(MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                                vocab_size=256, sliding_window=8, **small)), "lm"
    if name == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                            vocab_size=256, **small)), "lm"
    if name == "gpt-neox":
        return GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=64, num_attention_heads=4, vocab_size=256,
                                                hidden_dropout=0, attention_dropout=0, **small)), "lm"
    if name == "t5":
        from transformers import T5Config, T5ForConditionalGeneration
        return T5ForConditionalGeneration(T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                   num_heads=4, dropout_rate=0.1, decoder_start_token_id=0)), "seq2seq"
    return ViTForImageClassification(ViTConfig(hidden_size=64, num_attention_heads=2, image_size=32, patch_size=8,
                                               num_labels=3, hidden_dropout_prob=0, attention_probs_dropout_prob=0,
                                               **small)), "image"


@pytest.mark.parametrize("name", ["bert", "distilbert", "mistral", "qwen2", "gpt-neox", "vit", "t5"])
def test_more_hugging_face_architectures_train_bit_for_bit(device, name):
    def run(dev):
        torch.manual_seed(0)
        model, kind = _hf_model(name)
        model = model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(1)
        ids = torch.randint(1, 256, (2, 12), generator=data).to(dev)
        labels = torch.tensor([0, 2]).to(dev)
        if kind == "classify":
            out = model(input_ids=ids, labels=labels)
        elif kind == "seq2seq":  # with dropout: the node's generator, seeded just before
            targets = torch.randint(1, 256, (2, 7), generator=data).to(dev)
            torch.manual_seed(5)
            out = model(input_ids=ids, labels=targets)
        elif kind == "image":
            out = model(pixel_values=torch.randn(2, 3, 32, 32, generator=data).to(dev), labels=labels)
        else:
            out = model(input_ids=ids, labels=ids)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        return out.loss.item(), {k: v.detach().cpu() for k, v in model.state_dict().items()}

    cpu_loss, cpu_state = run("cpu")
    loss, state = run(device)
    assert loss == cpu_loss
    assert_states_equal(state, cpu_state)


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_hugging_face_generate_matches_cpu(device, build):
    """Generation with a KV cache: every token gives the attention new sequence lengths (the
    client infers their output layouts without fake tensors); greedy and seeded sampling give
    the tokens a CPU run gives, and a batch padded to its longest sequence trains like CPU."""
    torch.manual_seed(0)
    model = build().eval()
    prompt = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    torch.manual_seed(3)
    expected_sampled = model.generate(prompt, max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0)
    remote = model.to(device)
    got = remote.generate(prompt.to(device), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got.cpu(), expected)
    torch.manual_seed(3)
    sampled = remote.generate(prompt.to(device), max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0)
    assert torch.equal(sampled.cpu(), expected_sampled)


def test_variable_length_batches_train_bit_for_bit(device):
    """Batches padded to their own longest sequence: new shapes every step."""
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=2, vocab_size=128,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    results = []
    for dev in ("cpu", device):
        torch.manual_seed(0)
        model = BertForSequenceClassification(cfg).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(1)
        losses = []
        for length in (9, 14, 11, 20):
            ids = torch.randint(1, 128, (4, length), generator=data)
            mask = (torch.arange(length) < torch.randint(length // 2, length + 1, (4, 1), generator=data)).long()
            labels = torch.randint(0, 2, (4,), generator=data)
            loss = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), labels=labels.to(dev)).loss
            losses.append(optimizer_step(opt, loss))
        results.append((losses, host_state(model)))
    assert results[0][0] == results[1][0]
    for name, value in results[0][1].items():
        assert torch.equal(value, results[1][1][name]), name


def test_masked_bert_step_costs_one_round_trip(device):
    """transformers checks every attention mask for padding (``padding_mask.all()``), a read
    of a device tensor; the mask came from the host, so the client answers it itself: one
    round trip a step (the loss), the losses as on CPU, whether the batch is padded or not."""
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=2, vocab_size=128)
    data = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (4, 16), generator=data)
    padded = torch.ones(4, 16, dtype=torch.long)
    padded[1, 10:] = 0
    batches = [(ids, torch.ones(4, 16, dtype=torch.long)), (ids, padded)] * 3
    labels = torch.randint(0, 2, (4,), generator=data)
    results = []
    for dev in ("cpu", device):
        torch.manual_seed(0)
        model = BertForSequenceClassification(cfg).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, trips = [], []
        for batch_ids, mask in batches:
            before = gpuwire.stats()["round_trips"] if dev != "cpu" else 0
            torch.manual_seed(len(losses))  # dropout: the same stream on both devices
            loss = model(input_ids=batch_ids.to(dev), attention_mask=mask.to(dev), labels=labels.to(dev)).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if dev != "cpu":
                trips.append(gpuwire.stats()["round_trips"] - before)
        results.append(losses)
    assert results[1] == results[0]
    assert trips[2:] == [1, 1, 1, 1], trips  # (the first padded and unpadded steps learn layouts)


def test_quantization_aware_training_bit_for_bit(device):
    """QAT as PyTorch's tutorial sets it up (fused conv-bn-relu, ``get_default_qat_qconfig``):
    every weight goes through the fused observer + fake quantizer, whose kernel sizes its
    per-channel state on the first call. That resize happened on the node only, and from the
    second step on the scales drifted from CPU's."""
    import warnings

    import torch.ao.quantization as quantization

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = quantization.QuantStub(), quantization.DeQuantStub()
            self.conv, self.bn, self.relu = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()
            self.fc = torch.nn.Linear(4 * 6 * 6, 2)

        def forward(self, x):
            return self.dequant(self.fc(self.relu(self.bn(self.conv(self.quant(x)))).flatten(1)))

    batches = [torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    results = []
    for dev in ("cpu", device):
        torch.manual_seed(0)
        model = Net().train()
        model.qconfig = quantization.get_default_qat_qconfig("fbgemm")
        with warnings.catch_warnings():  # (PyTorch's deprecation notices of torch.ao.quantization)
            warnings.simplefilter("ignore")
            model = quantization.fuse_modules_qat(model, [["conv", "bn", "relu"]])
            quantization.prepare_qat(model, inplace=True)
        model.to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
        losses = []
        for x in batches:
            losses.append(optimizer_step(opt, model(x.to(dev)).square().mean()))
        results.append((losses, host_state(model)))
    assert results[0][0] == results[1][0]
    assert results[0][1]["conv.weight_fake_quant.scale"].shape == (4,)
    assert_states_equal(results[0][1], results[1][1])
