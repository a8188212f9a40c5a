"""What the compiled runtime must get right before its first GPU run, pinned on a CPU: the
inputs a CUDA graph needs static and aligned, outputs that outlive a replay copied, the counters
a compiled result records, the C-compiler fallback, GQA without a K/V copy, one device."""
import itertools
import types

import math

import pytest
import torch

from conftest import early_exit_parts, random_lm


def _recording_step(rt, calls):
    """Replace the compiled step by the plain function, recording its arguments."""
    from specee.runtime.compiled import layer_step

    def step(*args):
        calls.append(args)
        return layer_step(*args)
    rt._step = step


def _is_static(t) -> bool:
    return getattr(t, "_dynamo_static_input_type", None) == "unguarded"


def test_compiled_step_inputs_are_standalone_aligned_and_static_addresses():
    """A view at an offset (lengths_t[i] at 8*i bytes) is copied by inductor on every GPU call,
    and a mutated non-static input (the K/V buffers, the length) makes cudagraph trees skip the
    graph: every tensor the step takes is its own 16-byte-aligned storage, and the buffers, the
    length and the weights are marked static."""
    from specee.runtime.compiled import CompiledLM
    rt = CompiledLM(random_lm("llama", layers=3))
    calls = []
    _recording_step(rt, calls)
    cache = rt.new_cache(24)
    rt.forward(torch.randint(0, 100, (1, 7)), cache)  # the prompt: the model's own layers
    block = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    rt.forward(torch.tensor([[5]]), cache)
    rt.forward(torch.tensor([[6, 7, 8]]), cache, block_mask=block)
    assert len(calls) == 2 * rt.num_layers
    for n, args in enumerate(calls):
        i = n % rt.num_layers
        h, cos, sin, k_buf, v_buf, length, blk, ln1, w_qkv, b_qkv, w_o, b_o, ln2, w_gu, w_down = args[:15]
        assert k_buf is cache.keys[i] and v_buf is cache.values[i] and length is cache.length_ts[i]
        for t in (h, cos, sin, k_buf, v_buf, length, blk, ln1, w_qkv, w_o, ln2, w_gu, w_down):
            assert t.storage_offset() == 0 and t.data_ptr() % 16 == 0
        assert length.dim() == 0 and length.untyped_storage().nbytes() == 8  # not a view of a vector
        for t in (k_buf, v_buf, length, ln1, w_qkv, w_o, ln2, w_gu, w_down):
            assert _is_static(t)
    assert cache.lengths == [11, 11, 11] and cache.lengths_t.tolist() == [11, 11, 11]


def _specee_on(rt, layers):
    _, draft, bank = early_exit_parts(layers, rt=rt)
    return draft, bank


def test_predictor_inputs_are_standalone_and_its_output_is_copied_under_cuda_graphs():
    """bank.b2[i] is a 0-d view at 4*i bytes (misaligned): the compiled predictor gets per-layer
    copies. Its p outlives the call (the next layer's p_prev) while a layer graph replays in
    between: under CUDA graphs the runtime returns a copy, never the graph's own output."""
    from specee.runtime.compiled import CompiledLM
    from specee.decoding.specee_ar import SpecEEDecoder
    from specee.runtime.compiled import predictor_step
    rt = CompiledLM(random_lm("llama", layers=4))
    _recording_step(rt, [])  # plain functions: this test is about arguments, not compilation
    draft, bank = _specee_on(rt, 4)
    seen, outputs = [], []
    real = predictor_step

    def predict(*args):
        seen.append(args)
        out = real(*args)
        outputs.append(out[1])
        return out
    rt._predict = predict
    rt.cudagraphs = True  # what reduce-overhead on CUDA sets
    returned = []
    base = rt.predict
    rt.predict = lambda *a: returned.append(base(*a)) or returned[-1]
    SpecEEDecoder(rt, draft, bank).generate(torch.randint(0, 100, (1, 6)), 5)
    assert seen, "the compiled predictor never ran"
    for args in seen:
        for t in (args[0], args[1], args[4], *args[5:9]):
            assert t.storage_offset() == 0 and t.data_ptr() % 16 == 0
    for (_, p), out in zip(returned, outputs):
        assert p.data_ptr() != out.data_ptr() and torch.equal(p, out)


def test_predictor_copies_follow_the_bank():
    """Per-layer copies are rebuilt when the bank changes in place (training, loading)."""
    from specee.runtime.compiled import CompiledLM
    rt = CompiledLM(random_lm("llama", layers=2))
    _, bank = _specee_on(rt, 2)
    (b1, w1t, w2, b2), t = rt.predictor_params(bank, 1)
    assert torch.equal(b2, bank.b2[1]) and torch.equal(w1t, bank._w1t[1]) and _is_static(w1t)
    assert t == bank._logit_t
    with torch.no_grad():
        bank.b2[1] = 3.0
    assert float(rt.predictor_params(bank, 1)[0][3]) == 3.0
    # Per-layer thresholds fold into the bias: one graph (threshold 0) serves every layer.
    bank.set_layer_thresholds([0.5, 0.8])
    (_, _, _, b2), t = rt.predictor_params(bank, 1)
    assert t == 0.0 and float(b2) == pytest.approx(3.0 - math.log(0.8 / 0.2))
    bank.set_layer_thresholds([0.5, 1.0])  # never fires: the eager path decides
    assert rt.predictor_params(bank, 1)[1] == math.inf


def test_compiled_per_layer_thresholds_decide_as_eager():
    """The fused compiled predictor with per-layer thresholds fires exactly where the eager one does."""
    from specee.runtime.compiled import CompiledLM
    from specee.runtime.layerwise import LayerwiseLM
    model = random_lm("llama", layers=3)
    crt, ert = CompiledLM(model), LayerwiseLM(model)
    _, bank = _specee_on(crt, 3)
    from specee.early_exit.features import SpecProbe, features_from_logits, initial_p
    spec = torch.tensor([1, 2, 3, 4])
    g = torch.Generator().manual_seed(0)
    hs = [torch.randn(1, 1, model.config.hidden_size, generator=g) for _ in range(12)]
    with torch.no_grad():
        logits = [float(bank.logit(1, features_from_logits(SpecProbe(ert, spec).logits(h), initial_p(4, spec))[0]))
                  for h in hs]
    mid = sorted(logits)[len(logits) // 2]
    bank.set_layer_thresholds([0.5, 1 / (1 + math.exp(-mid)), 0.5])
    for h in hs:
        fe, _ = ert.predict(SpecProbe(ert, spec), bank, 1, h, initial_p(4, spec))
        probe = SpecProbe(crt, spec)
        assert probe.fast  # the fused compiled step, not the eager fallback
        fc, _ = crt.predict(probe, bank, 1, h, initial_p(4, spec))
        assert bool(fe) == bool(fc)
    assert 0 < sum(bool(ert.predict(SpecProbe(ert, spec), bank, 1, h, initial_p(4, spec))[0]) for h in hs) < len(hs)


def test_compiled_results_record_cudagraph_skips_and_captures(monkeypatch):
    """graph_stats reads inductor's skip counter and the cudagraph trees' graph count (without
    consuming it); off CUDA the capture count is None, not 0."""
    import specee.runtime.compiled as compiled
    from torch._dynamo.utils import counters
    rt = compiled.CompiledLM(random_lm("llama", layers=2))
    s0 = compiled.graph_stats(rt)
    assert s0["cudagraph_captures"] is None
    monkeypatch.setitem(counters["inductor"], "cudagraph_skips", counters["inductor"]["cudagraph_skips"] + 2)
    assert compiled.graph_stats(rt)["cudagraph_skips"] == s0["cudagraph_skips"] + 2
    from torch._inductor import cudagraph_trees
    manager = types.SimpleNamespace(graph_counter=itertools.count(5))
    monkeypatch.setattr(cudagraph_trees, "get_container", lambda index: types.SimpleNamespace(tree_manager=manager))
    assert compiled.cudagraph_captures("cuda:0") == 5 == compiled.cudagraph_captures("cuda:0")


def test_reduce_overhead_means_cuda_graphs_only_on_cuda():
    from specee.runtime.compiled import CompiledLM
    assert CompiledLM(random_lm("llama", layers=1), mode="reduce-overhead").cudagraphs is False  # CPU


def test_no_c_compiler_on_cuda_falls_back_instead_of_crashing(monkeypatch):
    """Triton builds a C launcher at its first kernel: without cc the run would die mid-decoding."""
    import importlib.util

    import specee.runtime.compiled as compiled
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # triton "installed"
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    assert "C compiler" in compiled.compiler_problem(torch.device("cuda"))
    monkeypatch.setattr(compiled.shutil, "which", lambda name: "/usr/bin/cc" if name == "cc" else None)
    assert compiled.compiler_problem(torch.device("cuda")) is None
    monkeypatch.setenv("CC", "clang-18")
    monkeypatch.setattr(compiled.shutil, "which", lambda name: "/x/clang-18" if name == "clang-18" else None)
    assert compiled.compiler_problem(torch.device("cuda")) is None


def test_gqa_attention_reads_the_cache_in_place(monkeypatch):
    """9/3 heads: attention reads the K/V buffers themselves (no repeat_interleave copy per layer
    per token) and gives the repeated-heads result."""
    import torch.nn.functional as F

    import specee.runtime.compiled as compiled
    torch.manual_seed(0)
    n_q, n_kv, hd, cap, t = 9, 3, 8, 12, 3
    d = n_q * hd
    h = torch.randn(1, t, d)
    cos, sin = torch.randn(1, t, hd), torch.randn(1, t, hd)
    k_buf, v_buf = torch.randn(1, n_kv, cap, hd), torch.randn(1, n_kv, cap, hd)
    block = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    w = dict(ln1=torch.rand(d) + 0.5, w_qkv=torch.randn((n_q + 2 * n_kv) * hd, d) / 8, b_qkv=None,
             w_o=torch.randn(d, d) / 8, b_o=None, ln2=torch.rand(d) + 0.5, w_gu=torch.randn(64, d) / 8,
             w_down=torch.randn(d, 32) / 8)

    def run(fn_kb, fn_vb):
        length = torch.tensor(5)
        return fn_kb, compiled.layer_step(h, cos, sin, fn_kb, fn_vb, length, block, w["ln1"], w["w_qkv"], w["b_qkv"],
                                          w["w_o"], w["b_o"], w["ln2"], w["w_gu"], w["w_down"], 1e-6, n_q, n_kv, hd)
    # the reference: the same step with K/V heads repeated (the old code path), as MHA
    ref_k, ref_v = k_buf.clone(), v_buf.clone()
    q_rows = w["w_qkv"][: n_q * hd]
    k_rows, v_rows = w["w_qkv"][n_q * hd: (n_q + n_kv) * hd], w["w_qkv"][(n_q + n_kv) * hd:]
    g = n_q // n_kv
    rep = lambda m: m.view(n_kv, hd, d).repeat_interleave(g, 0).reshape(n_q * hd, d)  # noqa: E731
    w_mha = torch.cat([q_rows, rep(k_rows), rep(v_rows)])
    length = torch.tensor(5)
    rep_k, rep_v = ref_k.repeat_interleave(g, 1), ref_v.repeat_interleave(g, 1)
    expect = compiled.layer_step(h, cos, sin, rep_k, rep_v, length,
                                 block, w["ln1"], w_mha, None, w["w_o"], None, w["ln2"], w["w_gu"], w["w_down"],
                                 1e-6, n_q, n_q, hd)
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def sdpa(q, k, v, **kw):
        seen.append((k.data_ptr(), v.data_ptr(), k.shape[1]))
        return real_sdpa(q, k, v, **kw)
    monkeypatch.setattr(compiled.F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **k: pytest.fail("K/V copied"))
    _, got = run(k_buf, v_buf)
    assert seen == [(k_buf.data_ptr(), v_buf.data_ptr(), n_kv)]
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_buf[:, :, 5:8], rep_k[:, ::g, 5:8])  # written in place, once per KV head
    torch.testing.assert_close(v_buf[:, :, 5:8], rep_v[:, ::g, 5:8])


def test_compiled_runtime_refuses_a_model_over_several_devices():
    from specee.runtime.compiled import CompiledLM
    from specee.errors import SpeceeError
    model = random_lm("llama", layers=2)
    model.model.layers[1].to("meta")
    with pytest.raises(SpeceeError, match="one device"):
        CompiledLM(model)


def test_requests_reuse_static_buffers_so_cuda_graphs_replay():
    """A CUDA graph reads its static inputs (K/V buffers, lengths) at recorded addresses: with
    cache_bucket a new request gets the buffers of a finished one of its shape, zeroed, rather
    than fresh ones that would make every graph record again inside the timed runs."""
    from specee.runtime.compiled import CompiledLM
    from specee.decoding.dense import DenseDecoder
    from specee.decoding.specee_ar import SpecEEDecoder
    rt = CompiledLM(random_lm("llama", layers=3), cache_bucket=16)
    calls = []
    _recording_step(rt, calls)
    draft, bank = _specee_on(rt, 3)
    ids = torch.randint(1, 100, (1, 5))
    inputs, held = [], []  # held: the tensors stay referenced, so an id cannot be reused
    for dec in (DenseDecoder(rt), DenseDecoder(rt), SpecEEDecoder(rt, draft, bank), SpecEEDecoder(rt, draft, bank)):
        calls.clear()
        dec.generate(ids, 6)
        held += [a[3:6] for a in calls]
        inputs.append({tuple(id(t) for t in a[3:6]) for a in calls})
    assert inputs[0] == inputs[1] and inputs[2] == inputs[3]  # the same tensors, not equal copies
    with torch.inference_mode():
        a = rt.new_cache(10)
        a.length_ts[0].fill_(3)
        a.keys[0].fill_(1.0)
    kept = a.keys[0]
    b = rt.new_cache(12)  # a is still in use: its own buffers
    assert b.keys[0] is not kept
    del a
    c = rt.new_cache(16)
    assert c.keys[0] is kept and c.lengths == [0, 0, 0] and c.seq_len == 0
    assert bool((c.keys[0] == 0).all()) and c.lengths_t.tolist() == [0, 0, 0]
    assert rt.new_cache(17).keys[0].shape[2] == 32  # another bucket: other buffers
