import torch

from conftest import random_lm
from specee.bench.bandwidth import bound, bytes_per_token, copy_bandwidth
from specee.runtime.layerwise import LayerwiseLM


def test_bytes_per_token_counts_layers_head_and_kv():
    model = random_lm("llama", layers=3)
    rt = LayerwiseLM(model)
    c = model.config
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    head = c.vocab_size * c.hidden_size
    kv_heads = c.num_key_value_heads
    head_dim = c.hidden_size // c.num_attention_heads
    b = bytes_per_token(rt, 10)
    assert b["weights"] == 4 * (3 * per_layer + c.hidden_size + head)  # float32; final norm's weight
    assert b["kv"] == 4 * 2 * 3 * kv_heads * head_dim * 10
    out = bound(rt, 10, 1e9)
    assert out["limit_ms_per_token"] == 1e3 * b["total"] / 1e9


def test_copy_bandwidth_is_a_plausible_rate():
    bw = copy_bandwidth(torch.device("cpu"), megabytes=16, repeats=2)
    assert 1e8 < bw < 1e13  # between 0.1 GB/s and 10 TB/s
