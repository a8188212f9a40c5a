"""Host syncs, device arguments and per-step work that a GPU run depends on, pinned on a CPU:
every host read or host-to-device copy of a decoding step is counted, synchronisation names the
model's device, the tree's mask is built once per step, a sharded model's K/V live with their
layers, and the weights fingerprint does not depend on the load dtype."""
import ast
import inspect

import pytest
import torch

from conftest import early_exit_parts, random_lm


# -- device arguments ---------------------------------------------------------------------
def test_synchronisation_names_the_models_device(monkeypatch):
    """torch.cuda.synchronize() without a device syncs the current device (cuda:0) while the
    model runs on cuda:1: the clock, the profiling timer and the energy meter pass theirs."""
    from specee.bench.power import EnergyMeter
    from specee.decoding.base import Clock, PhaseTimer
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    Clock("cuda:1")()
    timer = PhaseTimer("cuda:1", profile=True)
    timer.start()
    timer.lap("layers")

    class Backend:
        source = "fake"

        def energy_j(self):
            return 1.0

        def power_w(self):
            return None
    with EnergyMeter(Backend(), device="cuda:1").region():
        pass
    assert len(synced) == 5 and all(d == torch.device("cuda:1") for d in synced)
    Clock("cpu")()
    PhaseTimer("cpu", profile=True).lap("layers")
    assert len(synced) == 5  # a CPU run never touches CUDA


# -- counted host syncs -------------------------------------------------------------------
class HostReads:
    """Counts every host read of a tensor and every torch.tensor(..., device=...) built from host
    data while ``on``: what a GPU waits for."""

    def __init__(self, monkeypatch):
        self.n, self.on = 0, False
        for name in ("__int__", "__bool__", "__float__", "__index__", "item", "tolist"):
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(real))
        real_tensor = torch.tensor

        def tensor(data, *args, **kwargs):
            if self.on and kwargs.get("device") is not None:
                self.n += 1
            return real_tensor(data, *args, **kwargs)
        monkeypatch.setattr(torch, "tensor", tensor)

    def _wrap(self, real):
        def read(x, *args, **kwargs):
            if self.on:
                self.n += 1
                self.on = False  # nested reads (tolist -> item) are one read
                try:
                    return real(x, *args, **kwargs)
                finally:
                    self.on = True
            return real(x, *args, **kwargs)
        return read


def _parts(arch, layers=4):
    return early_exit_parts(layers, arch=arch)


def _decoders(arch):
    from specee.decoding.adainfer import AdaInferDecoder, AdaInferSVM
    from specee.decoding.specee_ar import SpecEEDecoder
    from specee.decoding.tree import TreeDecoder
    rt, draft, bank = _parts(arch)
    return {"specee_ar": SpecEEDecoder(rt, draft, bank),
            "specee_ar_propagate": SpecEEDecoder(rt, draft, bank, kv_policy="propagate"),
            "eagle_tree": TreeDecoder(rt, draft, "small"),
            "specee_tree_merged": TreeDecoder(rt, draft, "small", bank=bank, mapping="merged"),
            "specee_tree_independent": TreeDecoder(rt, draft, "small", bank=bank, mapping="independent"),
            "adainfer": AdaInferDecoder(rt, AdaInferSVM([4.0, 2.0], -1.5))}


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: a sliding window (the rope check)
def test_every_host_read_of_a_step_is_counted(monkeypatch, arch):
    """syncs_per_token is only right if each step's trace counts all its host reads: tensor ->
    int/bool/list and host lists copied to the device (a sync from pageable memory on CUDA)."""
    reads = HostReads(monkeypatch)
    for name, dec in _decoders(arch).items():
        counted = []
        real_step = dec.step

        def step(s, real_step=real_step):
            reads.n, reads.on = 0, True
            try:
                out = real_step(s)
            finally:
                reads.on = False
            counted.append(reads.n)
            return out
        dec.step = step
        gen = dec.generate(torch.randint(1, 100, (1, 7), generator=torch.Generator().manual_seed(3)), 12)
        traced = [t["syncs"] for t in gen.trace]
        assert traced and traced == counted, (arch, name)


STEP_FUNCTIONS = {"specee.decoding.specee_ar": ["SpecEEDecoder.step", "SpecEEDecoder.decode_one_token"],
                  "specee.runtime.exit_walk": ["host_walk"],
                  "specee.decoding.tree": ["TreeDecoder.step", "TreeDecoder.verify", "TreeDecoder.draft_tree"],
                  "specee.decoding.adainfer": ["AdaInferDecoder.step", "AdaInferDecoder.decode_one_token"]}


@pytest.mark.parametrize("module", sorted(STEP_FUNCTIONS))
def test_decoding_steps_copy_host_data_only_through_the_counted_helper(module):
    """No torch.tensor(...) / int(tensor) in a step's source: host data goes through the timer."""
    import importlib
    mod = importlib.import_module(module)
    for qual in STEP_FUNCTIONS[module]:
        obj = mod
        for part in qual.split("."):  # Class.method or a module-level function
            obj = getattr(obj, part)
        tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(obj)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                assert not (node.func.attr == "tensor" and getattr(node.func.value, "id", "") == "torch"), qual


def test_rope_takes_the_last_position_from_the_host(monkeypatch):
    """A sliding-window model checks the last position against its window: from the host value
    the caller knows, not int(position_ids.max()) (an uncounted sync per token)."""
    from specee.errors import SpeceeError
    from specee.runtime.layerwise import LayerwiseLM
    rt = LayerwiseLM(random_lm("mistral", layers=1))
    pos = torch.tensor([[7]])
    monkeypatch.setattr(torch.Tensor, "max", lambda *a, **k: pytest.fail("position read from the device"))
    rt.rope(rt.embed(pos), pos, last=7)
    with pytest.raises(SpeceeError, match="sliding"):
        rt.rope(rt.embed(pos), pos, last=rt.sliding_window)


# -- per-step work ------------------------------------------------------------------------
def test_tree_verification_builds_its_mask_once_per_step(monkeypatch):
    """Eager tree verification asked every layer for the same additive mask (~L mask builds, each
    a few kernels, per step): built once per step and cached length."""
    from specee.decoding.dense import DenseDecoder
    from specee.decoding.tree import TreeDecoder
    from specee.runtime.layerwise import LayerwiseLM
    rt, draft, bank = _parts("llama", layers=6)
    builds = []
    real = LayerwiseLM._additive_mask
    in_verify = [False]

    def counting(self, past, t, block):
        if in_verify[0]:
            builds.append(past)
        return real(self, past, t, block)
    monkeypatch.setattr(LayerwiseLM, "_additive_mask", counting)
    for dec in (TreeDecoder(rt, draft, "small"), TreeDecoder(rt, draft, "small", bank=bank, mapping="merged")):
        real_verify = dec.verify
        steps = [0]

        def verify(*a, real_verify=real_verify, steps=steps, **k):
            in_verify[0] = True
            steps[0] += 1
            try:
                return real_verify(*a, **k)
            finally:
                in_verify[0] = False
        dec.verify = verify
        builds.clear()
        ids = torch.randint(1, 100, (1, 8), generator=torch.Generator().manual_seed(0))
        gen = dec.generate(ids, 16)
        assert 0 < len(builds) <= steps[0]
        if dec.predictors is None:  # lossless: still dense greedy, token for token
            assert gen.tokens == DenseDecoder(rt).generate(ids, 16).tokens


def test_a_remembered_mask_equals_a_fresh_one():
    from specee.runtime.layerwise import LayerwiseLM
    rt = LayerwiseLM(random_lm("llama", layers=1))
    block = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    wide = rt.mask_for(9, 3, block)
    assert rt.mask_for(9, 3, block) is wide  # the same step and length: not built again
    for past in range(10, 40):  # a fixed tree over a whole generation: the memo stays bounded
        rt.mask_for(past, 3, block)
    from specee.runtime.layerwise import MASK_MEMO_SIZE
    assert len(rt._mask_memo[3]) == MASK_MEMO_SIZE
    for past in (9, 5, 0):
        assert torch.equal(rt.mask_for(past, 3, block), rt._additive_mask(past, 3, block))
    assert rt.mask_for(9, 3, block) is not None and wide.shape[-1] == 12
    other = block.clone()
    other[2, 1] = True
    assert torch.equal(rt.mask_for(5, 3, other), rt._additive_mask(5, 3, other))  # a new block: rebuilt
    other[2, 0] = False  # changed in place: rebuilt too
    assert torch.equal(rt.mask_for(5, 3, other), rt._additive_mask(5, 3, other))


def test_a_sharded_models_cache_lives_with_each_layer():
    """device_map=auto spreads layers over GPUs: each layer's K/V on its layer's device, not all
    on the embedding's (meta stands in for a second device)."""
    from specee.runtime.layerwise import LayerKVCache, LayerwiseLM
    model = random_lm("llama", layers=3)
    model.model.layers[2].to("meta")
    rt = LayerwiseLM(model)
    cache = rt.new_cache(8)
    assert [k.device.type for k in cache.keys] == ["cpu", "cpu", "meta"]
    assert [v.device.type for v in cache.values] == ["cpu", "cpu", "meta"]
    assert rt.new_cache(8, num_layers=1).keys[0].device.type == "cpu"  # the draft: with layer 0
    assert LayerKVCache(2, 1, 4, torch.float32, "cpu", 4).keys[1].device.type == "cpu"


def test_the_weights_fingerprint_does_not_depend_on_the_load_dtype(tiny):
    """tiny is stored in bf16; loaded in float16 a few tiny values change: its draft and
    predictors must still be recognised as trained for it."""
    import json

    from transformers import AutoModelForCausalLM

    from conftest import TINY
    from specee.models.loader import weights_fingerprint
    model, _ = tiny
    want = json.loads((TINY.parent / "tiny_draft" / "draft_card.json").read_text())["base_weights_fingerprint"]
    assert weights_fingerprint(model) == want
    half = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float16)
    assert weights_fingerprint(half) == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_tree_mask_has_the_layout_cudas_attention_kernel_reads(dtype):
    """CUDA's memory-efficient SDPA kernel reads an attention mask at its data pointer without
    checking alignment (pytorch/pytorch#183484): a mask sliced from column k > 0 of a wider one
    crashed float16/bfloat16 tree decoding on an H200 with "misaligned address". Every mask the
    runtime hands a layer (target and draft, EAGLE and SpecEE in the tree, prompts of different
    lengths) starts its own storage and has rows of a multiple of 8 entries (16-byte aligned)."""
    from specee.decoding.tree import TreeDecoder
    from specee.runtime.layerwise import LayerwiseLM
    rt, draft, bank = early_exit_parts(6, rt=LayerwiseLM(random_lm("llama", layers=6, seed=0).to(dtype)))
    draft.to(dtype)
    seen = []
    real = LayerwiseLM.step_layer

    def recording(self, layer, i, h, rope, cache, block_mask=None, position_ids=None):
        if block_mask is not None:
            seen.append(self.mask_for(cache.lengths[i], h.shape[1], block_mask))
        return real(self, layer, i, h, rope, cache, block_mask, position_ids)
    real_draft_layer = type(draft.layer).forward

    def draft_layer(self, x, attention_mask=None, **k):
        if attention_mask is not None:
            seen.append(attention_mask)
        return real_draft_layer(self, x, attention_mask=attention_mask, **k)
    import unittest.mock as um
    with um.patch.object(LayerwiseLM, "step_layer", recording), \
            um.patch.object(type(draft.layer), "forward", draft_layer):
        for dec in (TreeDecoder(rt, draft, "small"), TreeDecoder(rt, draft, "small", bank=bank, mapping="merged")):
            for n in (11, 8, 5):  # shorter prompts after longer ones: a remembered wider mask
                ids = torch.randint(1, 100, (1, n), generator=torch.Generator().manual_seed(n))
                dec.generate(ids, 8)
    assert len(seen) > 10
    for m in seen:
        assert m.storage_offset() == 0, m.storage_offset()
        assert m.stride(-2) % 8 == 0, m.stride()
        assert m.data_ptr() % 16 == 0
