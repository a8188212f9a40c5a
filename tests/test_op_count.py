"""The eager dense loop dispatches no more aten ops per decoded token than the model's own forward.

Counted with a TorchDispatchMode over the same 5 greedy decode steps on the committed tiny model:
``DenseDecoder(LayerwiseLM(model))`` steps against the HF model's forward over its DynamicCache, one
token at a time. At batch 1 every dispatch costs host time, so this pins the harness's own overhead
(issue 41: the loop once dispatched 1,916 ops per token against the forward's 1,787).
"""
import torch

from specee.bench.op_count import OpCounter, hf_forward_ops, histogram_diff, loop_ops, per_token
from specee.decoding.dense import DenseDecoder
from specee.runtime.layerwise import LayerKVCache, LayerwiseLM

STEPS = 5


def test_dense_loop_dispatches_no_more_ops_per_token_than_the_hf_forward(tiny):
    model, _ = tiny
    ids = torch.tensor([[1, 5, 9, 20, 33, 7, 12, 40]])
    dense = loop_ops(DenseDecoder(LayerwiseLM(model)), ids, STEPS)
    hf = hf_forward_ops(model, ids, STEPS)
    diff = "\n".join(f"  {op:24s} dense {a:7.1f}  hf {b:7.1f}" for op, a, b in histogram_diff(dense, hf, STEPS))
    print(f"aten ops per decoded token on tiny: dense loop {per_token(dense, STEPS):.0f}, "
          f"HF forward {per_token(hf, STEPS):.0f}\n{diff}")
    assert per_token(dense, STEPS) <= per_token(hf, STEPS), diff
    # Both sides counted something real: the layers' projections, seven per layer, and attention.
    layers = model.config.num_hidden_layers
    for ops in (dense, hf):
        assert ops["aten.linear"] / STEPS >= 7 * layers and ops["aten.scaled_dot_product_attention"] / STEPS == layers


def test_the_counter_sees_a_cache_that_writes_in_place():
    """The count can fail: an in-place append (slice, copy, slice) costs 3 dispatches per tensor
    where a concatenation costs 1."""
    k = torch.zeros(1, 2, 1, 4)
    counts = {}
    for concat in (True, False):
        cache = LayerKVCache(1, 2, 4, torch.float32, "cpu", capacity=8, concat=concat)
        with OpCounter() as c:
            cache.update(k, k, 0)
        counts[concat] = sum(c.ops.values())
    assert counts == {True: 2, False: 6}


def test_appends_switch_from_concatenation_to_a_buffer_past_the_limit_with_the_same_entries():
    cache = LayerKVCache(1, 1, 2, torch.float32, "cpu", capacity=16, concat=True)
    cache.concat_limits = [4]  # entries: concatenate up to 4, then write in place
    plain = LayerKVCache(1, 1, 2, torch.float32, "cpu", capacity=2)  # in place, grown by doubling
    seen = []
    for step in range(7):
        kv = torch.full((1, 1, 1 + step % 2, 2), float(step))
        a, b = cache.update(kv, -kv, 0), plain.update(kv, -kv, 0)
        seen.append(cache.keys[0].shape[2])
        torch.testing.assert_close(a[0], b[0])
        torch.testing.assert_close(a[1], b[1])
        if step == 3:  # a rollback: the stale tail is cut off before the next concatenation
            cache.crop(cache.lengths[0] - 1)
            plain.crop(plain.lengths[0] - 1)
    assert seen[:2] == [1, 3]  # exact-size tensors while concatenating
    assert seen[-1] == 16  # the requested capacity once past the limit
    assert cache.lengths == plain.lengths
