"""Prompt lookup decoding: transformers' proposal rule, token identity with dense, settings."""
import random

import pytest
import torch

from conftest import ROOT, random_lm, run_cli
from specee.decoding.dense import DenseDecoder
from specee.decoding.pld import PromptLookupDecoder, propose
from specee.errors import SpeceeError
from specee.runtime.layerwise import LayerwiseLM


def _hf_candidates(ids, num_tokens, ngram, eos, max_length):
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
    gen = PromptLookupCandidateGenerator(eos_token_id=None if eos is None else torch.tensor([eos]),
                                         num_output_tokens=num_tokens, max_matching_ngram_size=ngram,
                                         max_length=max_length)
    t = torch.tensor([ids])
    out, _ = gen.get_candidates(t)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("seed", range(40))
def test_proposals_are_transformers_prompt_lookup(seed):
    """The real PromptLookupCandidateGenerator and :func:`propose` on random texts of a small
    vocabulary (so n-grams recur), with EOS in the text and budgets that cut the proposal."""
    rng = random.Random(seed)
    ids = [rng.randrange(6) for _ in range(rng.randrange(2, 40))]
    num_tokens, ngram = rng.randrange(1, 12), rng.randrange(1, 4)
    eos = rng.choice([None, 0, 5])
    max_length = len(ids) + rng.choice([1, 2, 5, 64])
    assert propose(ids, num_tokens, ngram, eos, max_length) == _hf_candidates(ids, num_tokens, ngram, eos, max_length)


def test_proposal_takes_the_first_occurrence_of_the_longest_ngram():
    ids = [1, 2, 3, 9, 8, 2, 3, 7, 6, 1, 2, 3]
    assert propose(ids, 3, 3) == [9, 8, 2]          # "1 2 3" seen at 0: what followed it
    assert propose(ids, 3, 1) == [9, 8, 2]          # "3" first seen at 2
    assert propose([4, 5, 6], 3, 2) == []           # nothing recurs
    assert propose([1, 2, 0, 1, 2], 4, 2, eos_id=0) == []  # the first match is followed by EOS


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pld_is_dense_token_for_token(arch):
    rt = LayerwiseLM(random_lm(arch, layers=3, seed=1))
    dense, pld = DenseDecoder(rt), PromptLookupDecoder(rt, num_tokens=4, ngram_size=2)
    accepted = []
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(1, 101, (1, 6), generator=g)
        ids = base.repeat(1, 3)  # repeated text: lookups match, some proposals are accepted
        ref, got = dense.generate(ids, 24), pld.generate(ids, 24)
        assert got.tokens == ref.tokens
        accepted += [t["accepted"] for t in got.trace]
    assert max(accepted) > 1  # some step emitted more than one token
    assert sum(accepted) / len(accepted) >= 1


def test_pld_matches_transformers_generate_on_tiny(tiny):
    model, tok = tiny
    rt = LayerwiseLM(model)
    text = "Once upon a time there was a cat. The cat was happy. Once upon a time there was a"
    ids = tok(text, return_tensors="pt").input_ids
    ours = PromptLookupDecoder(rt, num_tokens=10, ngram_size=2).generate(ids, 24).tokens
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                        prompt_lookup_num_tokens=10, pad_token_id=tok.eos_token_id, temperature=None, top_p=None,
                        top_k=None)[0, ids.shape[1]:].tolist()
    assert ours == hf[:len(ours)] and len(ours) == len(hf)


def test_bad_settings_are_refused():
    rt = LayerwiseLM(random_lm("llama", layers=2))
    for n, g in ((0, 2), (3, 0), (-1, 1)):
        with pytest.raises(SpeceeError, match="num_tokens"):
            PromptLookupDecoder(rt, num_tokens=n, ngram_size=g)


@pytest.mark.parametrize("override, message", [("ablation.num_tokens=0", "ablation.num_tokens=0 must be a whole number in [1, 64] or auto"),
                                               ("ablation.ngram_size=0", "ablation.ngram_size=0 must be >= 1"),
                                               ("ablation.decoding=tree", "ablation.mode=pld verifies one proposal")])
def test_bad_pld_config_is_one_line(override, message, tmp_path):
    res = run_cli("experiment=speed", "model=tiny", "ablation=pld", override, f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_pld_speed_run_writes_its_figures(tmp_path):
    res = run_cli("experiment=speed", "model=tiny", "ablation=pld", "dataset.count=1", "dataset.categories=[summarization]",
                  "dataset.max_new_tokens=12", "experiment.repeats=1", "experiment.cost_rounds=3", "threads=1",
                  "ablation.lookup_calibration_prompts=2",
                  f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-2000:]
    import json
    m = json.loads((tmp_path / "results.json").read_text())["metrics"]
    assert m["match_rate_vs_dense"] == 1.0 and m["mean_accepted_length"] >= 1
    lo, hi = m["speedup_vs_dense_ci"]
    assert lo <= m["speedup_vs_dense"] <= hi
    c = m["cost_model"]
    assert "block_costs" in c and c["modelled_speedup_vs_dense"] > 0 and "1" in c["block_costs"]["median_us"]
    pl = m["prompt_lookup"]
    assert pl["num_tokens_setting"] == "auto" and 0 <= pl["match_share"] <= 1
    choice = pl["num_tokens_choice"]  # the length chosen from c(n) measured here, and why
    assert pl["num_tokens"] == choice["chosen"] and 1 <= choice["chosen"] <= 16
    assert abs(choice["predicted_speedup"] - max(choice["predicted_speedup_by_num_tokens"].values())) < 1e-3
    assert set(choice["calibration_prompt_ids"]).isdisjoint({p["id"] for p in json.loads(
        (tmp_path / "results.json").read_text())["prompts"]})  # calibration disjoint from evaluation
    # transformers' prompt lookup at the same settings, in the same run: same tokens, same tau (within 5 %)
    p = m["peer"]
    assert p["name"] == "hf_pld" and p["generate_kwargs"]["prompt_lookup_num_tokens"] == pl["num_tokens"]
    assert p["identical_to_mode_share"] == 1.0 and abs(p["mode_over_peer_accepted_length"] - 1) <= 0.05
    assert m["speedup_vs_hf_pld"] == p["mode_speedup_vs_peer"]
    assert (ROOT / "conf" / "ablation" / "pld.yaml").is_file()
