"""Tiny configs of transformers architectures for the dry-run zoo (built with random weights).

Each entry is a ``config.json`` body: ``architectures`` names the class to build, the rest are
the smallest dimensions that keep the architecture's features (grouped-query attention,
sliding windows, experts, shared experts, state-space mixers, ...).
"""

from __future__ import annotations

from typing import Any

# Shared sizes of the decoders: 2 layers, hidden 32, 4 heads (2 key-value heads).
_DEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip
_ENC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=256, max_position_embeddings=64)  # fmt: skip
_MOE = dict(_DEC, num_local_experts=4, num_experts_per_tok=2)

#: family -> (kind, config.json body)
ZOO: dict[str, tuple[str, dict[str, Any]]] = {
    # dense decoders
    "gpt2": ("decoder", dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=32,
                             n_layer=2, n_head=4, vocab_size=256, n_positions=64)),
    "llama": ("decoder", dict(_DEC, model_type="llama", architectures=["LlamaForCausalLM"])),
    "mistral": ("decoder", dict(_DEC, model_type="mistral", architectures=["MistralForCausalLM"],
                                sliding_window=8)),
    "qwen2": ("decoder", dict(_DEC, model_type="qwen2", architectures=["Qwen2ForCausalLM"])),
    "gemma2": ("decoder", dict(_DEC, model_type="gemma2", architectures=["Gemma2ForCausalLM"],
                               head_dim=8, sliding_window=8)),
    "phi3": ("decoder", dict(_DEC, model_type="phi3", architectures=["Phi3ForCausalLM"],
                             pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gpt_neox": ("decoder", dict(_ENC, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])),
    "opt": ("decoder", dict(model_type="opt", architectures=["OPTForCausalLM"], hidden_size=32,
                            ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                            max_position_embeddings=64, word_embed_proj_dim=32)),
    # encoders
    "bert": ("encoder", dict(_ENC, model_type="bert", architectures=["BertForMaskedLM"])),
    "roberta": ("encoder", dict(_ENC, model_type="roberta", architectures=["RobertaForMaskedLM"],
                                pad_token_id=1, max_position_embeddings=80)),
    "deberta_v2": ("encoder", dict(_ENC, model_type="deberta-v2",
                                   architectures=["DebertaV2ForMaskedLM"])),
    "electra": ("encoder", dict(_ENC, model_type="electra", architectures=["ElectraForMaskedLM"],
                                embedding_size=32)),
    # encoder-decoders
    "t5": ("seq2seq", dict(model_type="t5", architectures=["T5ForConditionalGeneration"],
                           d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                           vocab_size=256, decoder_start_token_id=0, pad_token_id=0)),
    "bart": ("seq2seq", dict(model_type="bart", architectures=["BartForConditionalGeneration"],
                             d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
                             encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                             decoder_attention_heads=4, vocab_size=256,
                             max_position_embeddings=64)),
    # vision
    "vit": ("vision", dict(model_type="vit", architectures=["ViTForImageClassification"],
                           hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=32, patch_size=8, num_labels=10)),
    "convnext": ("vision", dict(model_type="convnext",
                                architectures=["ConvNextForImageClassification"], image_size=32,
                                hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                drop_path_rate=0.1, num_labels=10)),
    "resnet": ("vision", dict(model_type="resnet", architectures=["ResNetForImageClassification"],
                              embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                              image_size=32, num_labels=10)),
    # shifted windows: a relative-position table indexed by a constant index, a cyclic-shift
    # mask built from arange, stages handing their output on permuted (window 4 over 8 x 8
    # patches: the first stage's second block shifts)
    "swin": ("vision", dict(model_type="swin", architectures=["SwinForImageClassification"],
                            image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
                            num_heads=[2, 4], window_size=4, num_labels=10)),
    # state-space
    "mamba": ("ssm", dict(model_type="mamba", architectures=["MambaForCausalLM"], hidden_size=32,
                          state_size=8, num_hidden_layers=2, vocab_size=256, expand=2,
                          conv_kernel=4)),
    # mixtures of experts
    "mixtral": ("moe", dict(_MOE, model_type="mixtral", architectures=["MixtralForCausalLM"])),
    "qwen2_moe": ("moe", dict(_DEC, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
                              moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                              shared_expert_intermediate_size=32)),
    "olmoe": ("moe", dict(_DEC, model_type="olmoe", architectures=["OlmoeForCausalLM"],
                          num_experts=4, num_experts_per_tok=2)),
    "switch": ("moe", dict(model_type="switch_transformers",
                           architectures=["SwitchTransformersForConditionalGeneration"],
                           d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                           num_decoder_layers=2, num_sparse_encoder_layers=1,
                           num_sparse_decoder_layers=1, num_experts=4, vocab_size=256,
                           expert_capacity=64, decoder_start_token_id=0, pad_token_id=0)),
    "jamba": ("moe", dict(_DEC, model_type="jamba", architectures=["JambaForCausalLM"],
                          num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                          expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
                          mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                          use_mamba_kernels=False)),
}
