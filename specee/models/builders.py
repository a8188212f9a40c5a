"""Builders for the embedded `tiny` reference model: its tokenizer and its Llama config."""
from __future__ import annotations

from typing import Iterable

from transformers import LlamaConfig, PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style pre-tokenisation), so any input string is encodable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=None, pad_token=EOS,
        model_max_length=1024,
    )


def tiny_config(vocab_size: int, hidden_size: int = 192, intermediate_size: int = 512,
                num_layers: int = 24, num_heads: int = 6, num_kv_heads: int = 2,
                max_positions: int = 1024, eos_token_id: int = 0) -> LlamaConfig:
    """A deep, narrow Llama: depth matters for exit-layer statistics (>= 24 layers)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,  # as Llama-2: the draft head shares lm_head, not embeddings
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
