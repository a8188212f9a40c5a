import pytest
import torch

from conftest import random_lm
from specee.decoding.dense import DenseDecoder
from specee.runtime.layerwise import LayerwiseLM


def hf_greedy(model, ids, n):
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_dense_greedy_matches_hf_generate_random_init(arch):
    model = random_lm(arch)
    rt = LayerwiseLM(model)
    for seed in range(3):
        ids = torch.randint(1, 101, (1, 5 + 7 * seed), generator=torch.Generator().manual_seed(seed))
        ours = DenseDecoder(rt).generate(ids, 30, eos_id=None).tokens
        assert ours == hf_greedy(model, ids, 30)


def test_dense_greedy_matches_hf_generate_tiny(tiny):
    """Both stop at tiny's end-of-text token (it ends stories), which must then be the last token."""
    model, tok = tiny
    rt = LayerwiseLM(model)
    eos = tok.eos_token_id
    for text in ["Once upon a time, there was a little girl named", "Tom and his dog went to the park.",
                 "The old king of the mountain said"]:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)
        ref = out[0, ids.shape[1]:].tolist()
        if eos in ref:
            ref = ref[:ref.index(eos) + 1]
        assert DenseDecoder(rt).generate(ids, 48, eos_id=eos).tokens == ref


def test_layerwise_logits_equal_model_forward():
    model = random_lm("llama", layers=3)
    rt = LayerwiseLM(model)
    ids = torch.randint(1, 101, (1, 12))
    with torch.inference_mode():
        ref = model(ids).logits
        got = rt.logits(rt.forward(ids, rt.new_cache()))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_with_past_equals_one_block():
    """A multi-token block after cached tokens needs the explicit causal mask path."""
    model = random_lm("qwen2", layers=3)
    rt = LayerwiseLM(model)
    ids = torch.randint(1, 101, (1, 16))
    with torch.inference_mode():
        whole = rt.forward(ids, rt.new_cache())
        cache = rt.new_cache(capacity=4)  # also exercises buffer growth
        first = rt.forward(ids[:, :9], cache)
        second = rt.forward(ids[:, 9:], cache)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=1e-5, atol=1e-5)
    assert cache.lengths == [16, 16, 16] and cache.seq_len == 16


def test_cache_represents_a_token_that_ran_only_some_layers():
    model = random_lm("llama", layers=6)
    rt = LayerwiseLM(model)
    cache = rt.new_cache()
    ids = torch.randint(1, 101, (1, 8))
    with torch.inference_mode():
        rt.forward(ids, cache)
        rt.forward(torch.tensor([[7]]), cache, upto=2)  # an "exit" after layer 1
        assert cache.seq_len == 9
        assert cache.lengths == [9, 9, 8, 8, 8, 8]
        assert cache.missing_layers() == [2, 3, 4, 5]
        # The next token still gets position 9 (from seq_len, not from any layer's length).
        pos = rt.positions(cache, 1)
        assert pos.tolist() == [[9]]
        h = rt.forward(torch.tensor([[8]]), cache)
        assert h.shape == (1, 1, 64) and torch.isfinite(h).all()
        assert cache.lengths == [10, 10, 9, 9, 9, 9]
    cache.crop(8)
    assert cache.lengths == [8] * 6 and cache.seq_len == 8


def test_non_llama_layout_is_refused():
    from specee.errors import SpeceeError
    with pytest.raises(SpeceeError, match="Llama-family"):
        LayerwiseLM(torch.nn.Linear(2, 2))
