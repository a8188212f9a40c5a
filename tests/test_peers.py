"""Peer baselines (transformers' prompt lookup and self-speculation), the settings chosen from
measured costs (proposal length, self-speculation depth), and SpecEE with prompt-lookup speculation."""
import json

import pytest
import torch

from conftest import early_exit_parts, random_lm, run_cli
from specee.tuning.auto_settings import (choose_exit_layer, choose_num_tokens, replay_lookup_blocks,
                                           self_spec_speedup)
from specee.decoding.dense import DenseDecoder
from specee.decoding.hf_peer import HFGenerateDecoder, not_applicable
from specee.decoding.pld import PromptLookupDecoder
from specee.decoding.specee_ar import PromptLookupSpecEEDecoder, SpecEEDecoder, lookup_set
from specee.runtime.layerwise import LayerwiseLM


def _repeated_prompt(seed: int, vocab: int = 101):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (1, 6), generator=g).repeat(1, 3)  # n-grams recur: lookups match


@pytest.mark.parametrize("name, kwargs", [("hf_plain", {}),
                                          ("hf_pld", {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 2}),
                                          ("hf_self_spec", {"assistant_early_exit": 1})])
def test_transformers_peers_are_dense_token_for_token(name, kwargs):
    model = random_lm("llama", layers=3, seed=1)
    rt = LayerwiseLM(model)
    peer, dense = HFGenerateDecoder(model, rt, name, **kwargs), DenseDecoder(rt)
    for seed in range(3):
        ids = _repeated_prompt(seed)
        ref, got = dense.generate(ids, 20), peer.generate(ids, 20)
        assert got.tokens == ref.tokens
        # every token timed; a step's tokens share its time; the first comes from the prefill
        assert len(got.token_s) == len(got.tokens) and got.prefill_s == got.token_s[0] > 0
        in_prefill = len(got.tokens) - 1 - sum(t["emitted"] for t in got.trace)
        # self-speculation verifies its first draft inside the prefill forward: those tokens share its time
        assert in_prefill == 0 if name != "hf_self_spec" else 0 <= in_prefill <= 20


def test_transformers_prompt_lookup_accepts_what_ours_does():
    """Same rule, same text: the same tokens and the same tokens per verification step."""
    model = random_lm("llama", layers=3, seed=1)
    rt = LayerwiseLM(model)
    ours, hf = PromptLookupDecoder(rt, num_tokens=4, ngram_size=2), HFGenerateDecoder(model, rt, "hf_pld", prompt_lookup_num_tokens=4,
                                                                  max_matching_ngram_size=2)
    for seed in range(3):
        ids = _repeated_prompt(seed)
        a, b = ours.generate(ids, 24), hf.generate(ids, 24)
        assert a.tokens == b.tokens
        # tokens kept per step (the last step's may be cut by the budget, on both sides)
        assert [t["emitted"] for t in a.trace] == [t["emitted"] for t in b.trace]


def test_a_peer_transformers_refuses_is_one_line_not_a_traceback():
    model = random_lm("llama", layers=2)
    rt = LayerwiseLM(model)
    # transformers' own refusal: assisted generation takes no beam search
    peer = HFGenerateDecoder(model, rt, "hf_pld", prompt_lookup_num_tokens=4, num_beams=2)
    why = not_applicable(peer, _repeated_prompt(0), None)
    assert why is not None and why.startswith("transformers cannot run hf_pld") and "\n" not in why
    assert not_applicable(HFGenerateDecoder(model, rt, "hf_plain"), _repeated_prompt(0), None) is None


def test_lookup_replay_is_the_decoder_step_for_step():
    """The proposal-length choice replays prompt lookup over dense tokens: the blocks it predicts
    are the ones the decoder runs."""
    rt = LayerwiseLM(random_lm("llama", layers=3, seed=1))
    dense = DenseDecoder(rt)
    for n in (1, 3, 8):
        dec = PromptLookupDecoder(rt, num_tokens=n, ngram_size=2)
        for seed in range(3):
            ids = _repeated_prompt(seed)
            tokens = dense.generate(ids, 24).tokens
            got = dec.generate(ids, 24)
            assert replay_lookup_blocks(ids[0].tolist(), tokens, n, 2, None, 24) == [t["nodes"] for t in got.trace]


def test_non_monotone_block_costs_pick_the_cheaper_longer_proposal():
    """c(2) and c(3) cost more than c(5) (oneDNN's shape effect on a CPU): with the same tokens
    accepted either way, the longer proposal, whose block is cheaper, wins."""
    costs = {1: 10.0, 2: 21.0, 3: 20.0, 4: 14.0, 5: 13.0, 6: 30.0}
    # every step accepts its whole proposal: N=1 -> blocks of 2, N=4 -> blocks of 5
    replays = {1: [[2] * 10], 2: [[3] * 7], 4: [[5] * 4]}
    out = choose_num_tokens(replays, costs.__getitem__, decode_tokens=20)
    assert out["chosen"] == 4
    assert out["predicted_speedup"] == pytest.approx(10.0 * 20 / (4 * 13.0))
    assert out["predicted_speedup_by_num_tokens"]["1"] == pytest.approx(200 / 210, abs=1e-4)
    # a flat GPU-like c(n) with nothing ever accepted: every N is a loss; the shortest is chosen
    flat = choose_num_tokens({1: [[2] * 20], 8: [[9] * 20]}, lambda n: 10.0 + n, decode_tokens=20)
    assert flat["chosen"] == 1 and not flat["pays"]


def test_self_speculation_depth_trades_agreement_against_draft_cost():
    flat = lambda n: 1.0 + 0.05 * (n - 1)  # noqa: E731  (a GPU-like block cost)
    # agreement rises with depth; a cheap shallow draft that is often right wins
    agreement = [0.2, 0.85, 0.9, 0.92, 0.95, 0.97, 0.99, 1.0]
    out = choose_exit_layer(agreement, head_layers=0.5, block_ratio=flat)
    assert out["chosen"] == 2 and out["predicted_speedup"] > 1
    assert out["predicted_speedup"] == pytest.approx(self_spec_speedup(0.85, 2, 8, 0.5, flat, out["drafted_per_step"]))
    # a draft that is never right only costs: the modelled speedup is below 1 at every depth
    never = choose_exit_layer([0.0] * 8, head_layers=0.5, block_ratio=flat)
    assert never["predicted_speedup"] < 1


def test_lookup_set_takes_recent_continuations_of_the_longest_ngram():
    ids = [5, 6, 1, 5, 6, 2, 9, 5, 6, 3, 7, 5, 6]
    assert lookup_set(ids, 3, 2) == [3, 2, 1]  # after "5 6", most recent first
    assert lookup_set(ids, 4, 2) == [3, 2, 1]  # the shorter suffix "6" adds nothing new: fewer than k
    from collections import Counter
    assert lookup_set(ids, 4, 2, Counter(ids)) == [3, 2, 1, 5]  # filled with the most frequent token
    assert lookup_set([1, 2, 8, 3, 2, 9, 4, 2], 2, 2) == []  # "4 2" is new, though "2" recurs
    assert lookup_set([1, 2, 3, 4], 2, 2) == []  # "3 4" never occurred before
    assert lookup_set([4], 2, 2) == []


def test_specee_pld_without_matches_is_specee_and_with_matches_skips_the_draft():
    rt, draft, bank = early_exit_parts(layers=4)
    plain = SpecEEDecoder(rt, draft, bank, k=4)
    never = PromptLookupSpecEEDecoder(rt, draft, bank, k=4, ngram_size=12)  # a 12-gram never recurs here
    ids = torch.arange(1, 9).view(1, -1)
    a, b = plain.generate(ids, 12), never.generate(ids, 12)
    assert a.tokens == b.tokens and a.layers_run == b.layers_run
    assert all(t["spec_source"] == "draft" for t in b.trace)
    looked = PromptLookupSpecEEDecoder(rt, draft, bank, k=4, ngram_size=1)
    got = looked.generate(_repeated_prompt(0), 16)
    sources = [t["spec_source"] for t in got.trace]
    assert "prompt" in sources
    assert all(t["draft_calls"] == (s == "draft") for t, s in zip(got.trace, sources))


def test_draft_catch_up_block_proposes_what_step_by_step_drafting_does():
    """Steps served by the prompt leave their (token, feature) pairs for the draft to read in one
    block later: its proposal then is the one it would have made reading them one by one."""
    rt, draft, _ = early_exit_parts(layers=3)
    d = rt.config.hidden_size
    torch.manual_seed(3)
    tokens, feats = torch.randint(1, 101, (1, 5)), torch.randn(1, 5, d)
    c1, c2 = draft.new_cache(16), draft.new_cache(16)
    with torch.inference_mode():
        one_by_one = [draft(tokens[:, i:i + 1], feats[:, i:i + 1], c1) for i in range(5)][-1]
        block = draft(tokens, feats, c2)
    torch.testing.assert_close(block[0, -1], one_by_one[0, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("override, message", [
    ("ablation.num_tokens=auto", "ablation.num_tokens=auto is the harness's choice"),
    ("ablation.num_tokens=-3", "ablation.num_tokens=-3 must be a whole number in [1, 64]"),
    ("ablation.ngram_size=0", "ablation.ngram_size=0 must be >= 1")])
def test_bad_hf_pld_settings_are_one_line(override, message, tmp_path):
    res = run_cli("experiment=speed", "model=tiny", "ablation=hf_pld", override, f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("args, message", [
    (("ablation=hf_self_spec", "ablation.exit_layer=32"), "ablation.exit_layer=32 must be auto or a layer count in [1, 31]"),
    (("ablation=hf_self_spec", "ablation.exit_layer=0"), "ablation.exit_layer=0 must be auto"),
    (("ablation=eagle", "ablation.speculation=prompt_lookup"), "ablation.speculation=prompt_lookup is autoregressive")])
def test_bad_peer_settings_are_one_line(args, message, tmp_path):
    res = run_cli("experiment=speed", "model=tiny", *args, "dataset.count=1", "dataset.categories=[summarization]",
                  "dataset.max_new_tokens=4", "experiment.cost_rounds=0", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("ablation", ["hf_pld", *(pytest.param(a, marks=pytest.mark.slow) for a in (
    "hf_self_spec", "specee_pld"))])  # hf_pld stays in the fast tier (the same peer path)
def test_peer_speed_runs_write_their_figures(ablation, tmp_path):
    res = run_cli("experiment=speed", "model=tiny", f"ablation={ablation}", "dataset.count=1",
                  "dataset.categories=[summarization]", "dataset.max_new_tokens=12", "experiment.cost_rounds=3",
                  "ablation.lookup_calibration_prompts=2", "threads=1", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads((tmp_path / "results.json").read_text())["metrics"]
    lo, hi = m["speedup_vs_dense_ci"]
    assert lo <= m["speedup_vs_dense"] <= hi
    if ablation == "specee_pld":
        s = m["speculation"]
        assert s["prompt"]["share"] + s["draft"]["share"] == pytest.approx(1.0)
        assert 0 <= m["match_rate_vs_dense"] <= 1
        return
    assert m["match_rate_vs_dense"] == 1.0 and m["mean_accepted_length"] >= 1  # lossless
    p = m["peer"]
    assert p["name"] == "hf_plain" and p["match_rate_vs_dense"] == 1.0 and p["identical_to_mode_share"] == 1.0
    assert m["speedup_vs_hf_plain"] == p["mode_speedup_vs_peer"]
    if ablation == "hf_self_spec":
        choice = m["transformers_peer"]["exit_layer_choice"]
        assert 1 <= choice["chosen"] < 32 and len(choice["agreement_by_layer"]) == 32
        assert m["transformers_peer"]["generate_kwargs"]["assistant_early_exit"] == choice["chosen"]


@pytest.mark.parametrize("ablation", ["hf_pld", "specee_pld"])
def test_speed_baselines_are_refused_outside_speed_runs(ablation, tmp_path):
    res = run_cli("experiment=accuracy", "model=tiny", f"ablation={ablation}", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2 and "is a speed baseline" in res.stderr and "Traceback" not in res.stderr
