"""Tiny random-weight configurations of Hugging Face architectures, with inputs and a loss.

Shared by tests/e2e/test_hf_zoo.py (each trains one step on the device and on CPU, bit for bit)
and tests/conformance/meta_vs_cpu.py (the aten calls they make)."""

from __future__ import annotations

import torch
import transformers as T

T.logging.set_verbosity_error()

VOCAB = 128
SMALL = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=2, vocab_size=VOCAB)
NO_VOCAB = {k: v for k, v in SMALL.items() if k != "vocab_size"}
SEQ2SEQ = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
               encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB)


def ids(batch=2, length=16, seed=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def text_lm():
    x = ids()
    return dict(input_ids=x, labels=x)


def classify_text():
    return dict(input_ids=ids(), attention_mask=torch.ones(2, 16, dtype=torch.long), labels=torch.tensor([0, 1]))


def seq2seq():
    return dict(input_ids=ids(), labels=ids(seed=2), attention_mask=torch.ones(2, 16, dtype=torch.long))


def classify_image():
    return dict(pixel_values=randn(2, 3, 32, 32, seed=3), labels=torch.tensor([0, 1]))


# name -> (build the model, make its inputs); models train with their default dropout
CASES = {
    "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, num_key_value_heads=1, max_position_embeddings=64,
                                                             sliding_window=8)), text_lm),
    "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**SMALL, num_key_value_heads=1, max_position_embeddings=64)),
              text_lm),
    "phi": (lambda: T.PhiForCausalLM(T.PhiConfig(**SMALL, max_position_embeddings=64)), text_lm),
    "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**SMALL, max_position_embeddings=64)), text_lm),
    "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(hidden_size=32, num_attention_heads=2, ffn_dim=64, num_hidden_layers=2,
                                                 vocab_size=VOCAB, max_position_embeddings=64,
                                                 word_embed_proj_dim=32)), text_lm),
    "gemma": (lambda: T.GemmaForCausalLM(T.GemmaConfig(**SMALL, num_key_value_heads=1, head_dim=16,
                                                       max_position_embeddings=64)), text_lm),
    # mixture of experts: top-k routing, a histc of int32 expert ids (CUDA-only on CPU kernels), grouped matmuls
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(**SMALL, num_key_value_heads=1, num_local_experts=4,
                                                             num_experts_per_tok=2, max_position_embeddings=64)),
                text_lm),
    "qwen2_moe": (lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**SMALL, num_key_value_heads=1, num_experts=4,
                                                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                                                 shared_expert_intermediate_size=32,
                                                                 max_position_embeddings=64)), text_lm),
    "mamba": (lambda: T.MambaForCausalLM(T.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB,
                                                       state_size=8)), text_lm),
    "roberta": (lambda: T.RobertaForSequenceClassification(T.RobertaConfig(**SMALL, max_position_embeddings=64)),
                classify_text),
    "albert": (lambda: T.AlbertForSequenceClassification(T.AlbertConfig(**SMALL, embedding_size=16)), classify_text),
    "electra": (lambda: T.ElectraForSequenceClassification(T.ElectraConfig(**SMALL, embedding_size=16)),
                classify_text),
    "deberta_v2": (lambda: T.DebertaV2ForSequenceClassification(T.DebertaV2Config(**SMALL, max_position_embeddings=64)),
                   classify_text),
    "bart": (lambda: T.BartForConditionalGeneration(T.BartConfig(**SEQ2SEQ, max_position_embeddings=64)), seq2seq),
    "whisper": (lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
        **SEQ2SEQ, num_mel_bins=16, max_source_positions=32, max_target_positions=32, pad_token_id=0,
        decoder_start_token_id=1, bos_token_id=1, eos_token_id=2)),
        lambda: dict(input_features=randn(2, 16, 64, seed=5), labels=ids(length=8))),
    "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(**NO_VOCAB, image_size=32, patch_size=8, num_labels=2)),
            classify_image),
    "convnext": (lambda: T.ConvNextForImageClassification(T.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1],
                                                                           num_stages=2, num_labels=2)), classify_image),
    "resnet": (lambda: T.ResNetForImageClassification(T.ResNetConfig(hidden_sizes=[8, 16], depths=[1, 1],
                                                                     embedding_size=8, num_labels=2)), classify_image),
    "swin": (lambda: T.SwinForImageClassification(T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                                               num_heads=[1, 2], window_size=4, num_labels=2)),
             classify_image),
    # (SpecAugment masking draws from NumPy's generator: off, so both runs see the same input)
    "wav2vec2": (lambda: T.Wav2Vec2Model(T.Wav2Vec2Config(**NO_VOCAB, conv_dim=(16, 16), conv_stride=(5, 2),
                                                          conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                                          num_conv_pos_embedding_groups=2, mask_time_prob=0.0,
                                                          layerdrop=0.0)),
                 lambda: dict(input_values=randn(2, 4000, seed=4))),
    "clip": (lambda: T.CLIPModel(T.CLIPConfig(
        text_config=dict(**SMALL, max_position_embeddings=32),
        vision_config=dict(**NO_VOCAB, image_size=32, patch_size=8))),
        lambda: dict(input_ids=ids(), pixel_values=randn(2, 3, 32, 32, seed=3), return_loss=True)),
    # session 10: architectures whose attention or routing works differently from the above
    "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1,
                                                             num_heads=2, vocab_size=VOCAB, decoder_start_token_id=0)),
           seq2seq),  # relative position buckets
    "switch": (lambda: T.SwitchTransformersForConditionalGeneration(T.SwitchTransformersConfig(
        d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, num_experts=4, vocab_size=VOCAB,
        decoder_start_token_id=0, encoder_sparse_step=1, decoder_sparse_step=1)), seq2seq),  # top-1 expert routing
    "bloom": (lambda: T.BloomForCausalLM(T.BloomConfig(hidden_size=32, n_head=2, n_layer=2, vocab_size=VOCAB)),
              text_lm),  # ALiBi through baddbmm
    "falcon": (lambda: T.FalconForCausalLM(T.FalconConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=2,
                                                          vocab_size=VOCAB)), text_lm),
    "gptj": (lambda: T.GPTJForCausalLM(T.GPTJConfig(n_embd=32, n_head=2, n_layer=2, vocab_size=VOCAB, rotary_dim=8,
                                                    n_positions=64)), text_lm),  # interleaved rotary
    "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**SMALL, num_key_value_heads=1, head_dim=16,
                                                          max_position_embeddings=64, sliding_window=8)),
               text_lm),  # logit soft-capping, sliding-window layers
    "modernbert": (lambda: T.ModernBertForSequenceClassification(T.ModernBertConfig(
        hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=2, vocab_size=VOCAB, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=2, local_attention=8)),
        classify_text),
    "xlnet": (lambda: T.XLNetLMHeadModel(T.XLNetConfig(d_model=32, n_head=2, d_inner=64, n_layer=2, vocab_size=VOCAB)),
              text_lm),  # two-stream relative attention in einsum
    "longformer": (lambda: T.LongformerForSequenceClassification(T.LongformerConfig(**SMALL, attention_window=4,
                                                                                   max_position_embeddings=64)),
                   classify_text),  # sliding chunks through as_strided views
    "funnel": (lambda: T.FunnelForSequenceClassification(T.FunnelConfig(d_model=32, n_head=2, d_head=16, d_inner=64,
                                                                        block_sizes=[1, 1], vocab_size=VOCAB,
                                                                        num_labels=2)), classify_text),
    "rwkv": (lambda: T.RwkvForCausalLM(T.RwkvConfig(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB,
                                                    attention_hidden_size=32, intermediate_size=64, context_length=64)),
             text_lm),  # a recurrence written in Python, token by token
    "segformer": (lambda: T.SegformerForImageClassification(T.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], num_attention_heads=[1, 2],
        patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2], num_labels=2)), classify_image),
    "mobilevit": (lambda: T.MobileViTForImageClassification(T.MobileViTConfig(
        image_size=32, hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32], num_labels=2)),
        classify_image),  # unfold/fold of patches

}


def loss_of(out):
    if getattr(out, "loss", None) is not None:
        return out.loss
    return out.last_hidden_state.float().pow(2).mean()
