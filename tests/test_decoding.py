"""The decoder interface: one generation loop for every mode, device-correct tensors, phase split
and host-sync counts."""
import pytest
import torch

from conftest import early_exit_parts
from specee.decoding import base
from specee.decoding.adainfer import AdaInferCRF, AdaInferDecoder, AdaInferSVM
from specee.decoding.dense import DenseDecoder
from specee.decoding.pld import PromptLookupDecoder
from specee.decoding.specee_ar import SpecEEDecoder
from specee.decoding.tree import TreeDecoder
from specee.early_exit.schedule import TwoLevelSchedule

K, L = 4, 6


@pytest.fixture(scope="module")
def parts():
    return early_exit_parts(L, K)


def decoders(rt, draft, bank):
    """Every decoding mode, both KV policies and both tree mappings, scheduled and not."""
    svm = AdaInferSVM([4.0, 2.0], -1.0)
    sched = lambda: TwoLevelSchedule(L, [2, 3], True, 2, 1, False)  # noqa: E731
    out = {"dense": DenseDecoder(rt)}
    for policy in ("holes", "propagate"):
        out[f"adainfer/{policy}"] = AdaInferDecoder(rt, svm, kv_policy=policy)
        out[f"specee_t1/{policy}"] = SpecEEDecoder(rt, draft, bank, k=K, kv_policy=policy)
        out[f"specee_t1_t2/{policy}"] = SpecEEDecoder(rt, draft, bank, k=K, kv_policy=policy, schedule=sched())
        for mapping in ("merged", "independent"):
            out[f"specee_full/{mapping}/{policy}"] = TreeDecoder(rt, draft, "small", bank=bank, schedule=sched(), mapping=mapping, k=K, kv_policy=policy)
    out["eagle"] = TreeDecoder(rt, draft, "small", k=K)
    out["specee_t1/shadow"] = SpecEEDecoder(rt, draft, bank, k=K, kv_policy="holes", schedule=sched(), shadow=True)
    out["pld"] = PromptLookupDecoder(rt, num_tokens=4, ngram_size=2)
    # AdaInfer's CRF over layers: stop when the filtered P(stop) passes 1/2
    out["adainfer_crf"] = AdaInferDecoder(rt, AdaInferCRF([[0.0, 0.0], [4.0, 2.0]], [0.0, -1.0], [[0.5, -0.5], [-0.5, 0.5]]))
    return out


def prompt():
    return torch.randint(1, 101, (1, 9), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", [
    "dense", "adainfer/holes", "adainfer/propagate", "specee_t1/holes", "specee_t1/propagate",
    "specee_t1_t2/holes", "specee_t1_t2/propagate", "specee_full/merged/holes",
    "specee_full/independent/propagate", "specee_full/merged/propagate", "specee_full/independent/holes",
    "eagle", "specee_t1/shadow", "pld", "adainfer_crf"])
def test_every_decoder_makes_its_tensors_on_the_runtime_device(parts, name):
    """Under a default device of "meta", any tensor a decoder creates without the runtime's device
    lands on meta and breaks the run; a device-correct decoder gives the same tokens as without."""
    rt, draft, bank = parts
    d = decoders(rt, draft, bank)[name]
    ids = prompt()
    ref = d.generate(ids, 16)
    with torch.device("meta"):
        got = d.generate(ids, 16)
    assert got.tokens == ref.tokens and got.layers_run == ref.layers_run
    if hasattr(d, "score") and not (isinstance(d, TreeDecoder) and d.predictors is not None):
        cont = ref.tokens[:5]
        want = d.score(ids, cont)
        with torch.device("meta"):
            have = d.score(ids, cont)
        assert have.layers == want.layers and have.logprobs == pytest.approx(want.logprobs)


def test_the_guard_catches_a_host_made_token(parts, monkeypatch):
    """The check can fail: a step that hands back torch.tensor(int) — made without a device, the
    bug this guard exists for — breaks under the meta default device."""
    rt, draft, bank = parts
    d = SpecEEDecoder(rt, draft, bank, k=K)
    real = d.decode_one_token

    def host_made(*args, **kwargs):
        nxt, f, exit_layer, trace, ex = real(*args, **kwargs)
        return torch.tensor(int(nxt)), f, exit_layer, trace, ex

    monkeypatch.setattr(d, "decode_one_token", host_made)
    ids = prompt()
    d.generate(ids, 8)  # fine on a CPU default device
    with torch.device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
        d.generate(ids, 8)


def test_every_mode_goes_through_the_one_loop(parts):
    rt, draft, bank = parts
    for name, d in decoders(rt, draft, bank).items():
        assert type(d).generate is base.LoopDecoder.generate, name
        full = d.generate(prompt(), 20)
        eos = full.tokens[3]
        stop = base.generate(d, prompt(), 20, eos_id=eos)
        assert stop.tokens == full.tokens[: full.tokens.index(eos) + 1], name
        assert len(stop.token_s) == len(stop.tokens) == len(stop.layers_run), name


@pytest.mark.parametrize("name", ["adainfer/holes", "specee_t1/holes", "specee_t1_t2/propagate",
                                  "specee_full/merged/holes", "eagle"])
def test_phase_split_covers_the_decode_time(parts, name):
    rt, draft, bank = parts
    gen = decoders(rt, draft, bank)[name].generate(prompt(), 24)
    phases = sum(t[k] for t in gen.trace for k in ("t_layers", "t_pred", "t_verify", "t_draft", "t_other"))
    assert 0.8 * gen.decode_s <= phases <= gen.decode_s * 1.001, (phases, gen.decode_s)


def test_host_syncs_are_counted(parts):
    rt, draft, bank = parts
    gen = SpecEEDecoder(rt, draft, bank, k=K).generate(prompt(), 24)
    for t in gen.trace:  # the draft's set, each predictor decision, each verification, the token
        assert t["syncs"] == 1 + t["pred_calls"] + t["verify_calls"] + 1
    tree = decoders(rt, draft, bank)["specee_full/merged/holes"].generate(prompt(), 24)
    for t in tree.trace:  # one read per active layer for all units, not one per unit
        assert t["syncs"] < t["pred_calls"] + t["verify_calls"] + 8


def test_noisy_reasons():
    from specee.bench.speed import noisy_reasons
    quiet = {"busy": False, "other_cpu_share": 0.0}
    ok = {"speedup_vs_dense": 1.01, "speedup_vs_dense_ci": [0.95, 1.07], "efficiency": 0.9}
    assert noisy_reasons(ok, "specee", quiet, quiet) == []
    off = {"speedup_vs_dense": 1.71, "speedup_vs_dense_ci": [1.4, 2.0]}
    assert "excludes 1" in noisy_reasons(off, "dense", quiet, quiet)[0]  # dense against itself
    fast = {**ok, "efficiency": 1.06}
    assert "efficiency" in noisy_reasons(fast, "specee", quiet, quiet)[0]
    assert noisy_reasons({**ok, "efficiency": 1.25}, "eagle", quiet, quiet, multi_token=True) == []
    busy = {"busy": True, "other_cpu_share": 0.9, "loadavg_1min": 3.1}
    assert "machine busy before" in noisy_reasons(ok, "specee", busy, quiet)[0]


def test_every_trace_key_is_declared_on_the_typed_step_trace(parts):
    """A step trace is typed (base.StepTrace): a key a decoder records is one its readers can look up."""
    rt, draft, bank = parts
    declared = set(base.StepTrace.__annotations__)
    for name, d in decoders(rt, draft, bank).items():
        for t in d.generate(prompt(), 12).trace:
            assert set(t) <= declared, (name, sorted(set(t) - declared))
