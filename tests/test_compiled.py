"""The compiled runtime: same numbers as the eager layers, lossless decoding, no recompiles."""
import json

import pytest
import torch

from conftest import ROOT, random_lm, run_cli


def _prefilled(rt, ids):
    cache = rt.new_cache(ids.shape[1] + 16)
    rt.forward(ids, cache)
    return cache


@pytest.mark.slow  # 34 s for qwen2 on a 2-core machine
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # GQA 4/2; qwen2 adds q/k/v biases
def test_compiled_layer_step_matches_the_model_layer(arch):
    from specee.runtime.compiled import CompiledLM, StaticKVCache
    from specee.runtime.layerwise import LayerwiseLM
    eager, comp = LayerwiseLM(random_lm(arch, layers=2)), CompiledLM(random_lm(arch, layers=2))
    assert comp.fallback is None
    ids = torch.randint(0, 100, (1, 9))
    ce, cc = _prefilled(eager, ids), _prefilled(comp, ids)
    assert isinstance(cc, StaticKVCache)
    # one token, then a 4-token block where token 3 sees 0 and 1 but not 2 (a tree's mask)
    block = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    for new, mask in ((torch.tensor([[7]]), None), (torch.tensor([[3, 4, 5, 6]]), block)):
        he, hc = eager.embed(new), comp.embed(new)
        pos = eager.positions(ce, new.shape[1])
        rope = eager.rope(he, pos)
        for i in range(2):
            he = eager.run_layer(i, he, rope, ce, mask, pos)
            hc = comp.run_layer(i, hc, rope, cc, mask, pos)
            assert torch.allclose(he, hc, atol=1e-5), (arch, i, (he - hc).abs().max())
            assert cc.lengths[i] == ce.lengths[i] == int(cc.lengths_t[i])
        ce.seq_len += new.shape[1]
        cc.seq_len += new.shape[1]
    for i in range(2):  # the K/V written by the compiled step are the eager layer's
        n = ce.lengths[i]
        assert torch.allclose(ce.keys[i][:, :, :n], cc.keys[i][:, :, :n], atol=1e-5)
        assert torch.allclose(ce.values[i][:, :, :n], cc.values[i][:, :, :n], atol=1e-5)


def test_static_cache_is_zeroed_fixed_and_says_when_full():
    """Attention reads the whole buffer (masked): a NaN in an unused entry would poison every
    output (0 x NaN), so buffers start zeroed; they are the compiled graph's inputs, so they
    never reallocate."""
    from specee.runtime.compiled import CompiledLM
    from specee.errors import SpeceeError
    assert CompiledLM(random_lm("llama", layers=2), cache_bucket=64).new_cache(10).keys[0].shape[2] == 64
    rt = CompiledLM(random_lm("llama", layers=2))
    cache = rt.new_cache(40)
    assert cache.keys[0].shape[2] == 40
    assert all(bool((b == 0).all()) for b in cache.keys + cache.values)
    ptr = cache.keys[1].data_ptr()
    rt.forward(torch.randint(0, 100, (1, 20)), cache)
    assert cache.keys[1].data_ptr() == ptr and cache.lengths_t.tolist() == [20, 20]
    cache.crop(12)
    assert cache.lengths == [12, 12] and cache.lengths_t.tolist() == [12, 12]
    with pytest.raises(SpeceeError, match="static KV cache full"):
        rt.forward(torch.randint(0, 100, (1, 29)), cache)  # 12 + 29 > 40


def test_without_a_compiler_it_runs_eagerly_and_says_why(monkeypatch):
    import specee.runtime.compiled as compiled
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    with pytest.warns(UserWarning, match="falls back to eager"):
        rt = compiled.CompiledLM(random_lm("llama", layers=2))
    assert "C++ compiler" in rt.fallback
    from specee.decoding.dense import DenseDecoder
    from specee.runtime.layerwise import LayerwiseLM
    model = random_lm("llama", layers=2)
    ids = torch.randint(0, 100, (1, 6))
    assert DenseDecoder(rt).generate(ids, 6).tokens == DenseDecoder(LayerwiseLM(model)).generate(ids, 6).tokens


def test_unsupported_layers_are_refused_with_the_fix():
    from transformers import LlamaConfig, LlamaForCausalLM
    from specee.runtime.compiled import CompiledLM
    from specee.errors import SpeceeError
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, mlp_bias=True)).eval()
    with pytest.raises(SpeceeError, match="use runtime=eager"):
        CompiledLM(model)


@pytest.fixture(scope="module")
def tiny_runtimes(tiny):
    """Eager and compiled runtimes over two copies of the committed tiny (fusion re-points weights)."""
    import copy
    from specee.runtime.compiled import CompiledLM
    from specee.runtime.layerwise import LayerwiseLM
    model, tok = tiny
    return LayerwiseLM(model), CompiledLM(copy.deepcopy(model)), tok


def _cfg(ablation):
    from hydra import compose, initialize_config_dir
    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"ablation={ablation}"])


PROMPTS = ["Once upon a time, there was a little girl named Lily. She",
           "Tom and his dog went to the park. They saw",
           "What is the capital of France? Answer:"]


@pytest.mark.parametrize("ablation", ["dense", "eagle", "specee_t1_t2", "specee_full"])
def test_compiled_decoding_agrees_with_eager_on_tiny(tiny_runtimes, ablation):
    """Lossless modes: identical tokens (float32, CPU). Early-exit modes: the same tokens and
    exit layers on the same inputs. After the first prompt no graph is compiled again."""
    from specee.runtime.compiled import compiled_graphs
    from specee.builders import build_decoder
    eager, comp, tok = tiny_runtimes
    cfg = _cfg(ablation)
    de, dc = build_decoder(cfg, eager), build_decoder(cfg, comp)
    compiles_after_first = 0
    for j, text in enumerate(PROMPTS):
        ids = tok(text, return_tensors="pt").input_ids
        before = compiled_graphs()
        ge, gc = de.generate(ids, 24), dc.generate(ids, 24)
        if j:
            compiles_after_first += compiled_graphs() - before
        assert gc.tokens == ge.tokens, (ablation, text)
        assert gc.layers_run == ge.layers_run, (ablation, text)
    assert compiles_after_first == 0


@pytest.mark.slow
def test_speed_run_on_the_compiled_runtime_reports_eager_beside_it(tmp_path):
    res = run_cli("experiment=speed", "runtime=compiled", "ablation=specee_t1_t2", "dataset.count=1",
                  "dataset.categories=[writing,math,coding]", "dataset.max_new_tokens=12",
                  f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((tmp_path / "results.json").read_text())["metrics"]
    r = m["runtime"]
    assert r["kind"] == "compiled" and r["fallback"] is None
    assert r["graphs_compiled_in_warmup"] >= 2 and r["graphs_compiled_in_timed_runs"] == 0
    assert r["compile_s"] > 0
    # CUDA-graph counters are recorded in every compiled result (a CPU run captures none)
    assert r["cudagraphs"] is False and r["cudagraph_captures_in_timed_runs"] is None
    assert r["cudagraph_skips_in_warmup"] == 0 and r["cudagraph_skips_in_timed_runs"] == 0
    assert r["compiled_calls_in_timed_runs"] > 0
    assert m["eager_dense"]["identical_to_runtime_dense_share"] == 1.0
    assert m["speedup_vs_eager_dense"] > 0 and m["dense"]["speedup_vs_eager_dense"] > 0
    assert m["eager_dense"]["ms_per_token_over_limit"] > 0


def test_an_unknown_runtime_is_refused_at_compose_time(tmp_path):
    res = run_cli("experiment=speed", "runtime=eager", "runtime.kind=jit", f"hydra.run.dir={tmp_path}")
    assert res.returncode != 0 and "runtime.kind='jit' is unknown" in res.stderr and "Traceback" not in res.stderr


def _like_a_cuda_graph_replay(fn, outputs: list):
    """``fn`` as CUDA-graph trees run it when every call starts a new generation (the same graph
    replayed layer after layer): the outputs of earlier calls are overwritten. Here they are
    poisoned (NaN, inverted booleans) before the call, so a caller that still holds one reads
    garbage — what the GPU does, shown on a CPU."""
    def call(*args):
        for t in outputs:
            if t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.fill_(float("nan"))
        outputs.clear()
        res = fn(*args)
        outputs.extend(x for x in (res if isinstance(res, tuple) else (res,)) if isinstance(x, torch.Tensor))
        return res
    return call


@pytest.mark.parametrize("ablation", ["dense", "specee_t1_t2"])
def test_compiled_decoding_survives_cuda_graph_output_reuse(tiny_runtimes, ablation, monkeypatch):
    """With CUDA graphs on, a layer step's or predictor's output must be copied before the next
    graph runs (the GPU check's 7B dense step failed on exactly this: 'accessing tensor output of
    CUDAGraphs that has been overwritten by a subsequent run'). Replay semantics simulated on the
    CPU: decoding stays token-identical to eager."""
    from specee.builders import build_decoder
    eager, comp, tok = tiny_runtimes
    outputs: list = []
    monkeypatch.setattr(comp, "cudagraphs", True)
    monkeypatch.setattr(comp, "_step", _like_a_cuda_graph_replay(comp._step, outputs))
    monkeypatch.setattr(comp, "_predict", _like_a_cuda_graph_replay(comp._predict, outputs))
    cfg = _cfg(ablation)
    de, dc = build_decoder(cfg, eager), build_decoder(cfg, comp)
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    ge, gc = de.generate(ids, 12), dc.generate(ids, 12)
    assert outputs, "the compiled step never ran"
    assert gc.tokens == ge.tokens and gc.layers_run == ge.layers_run
