"""Measurement design: step-level interleaving, prompts cut to the context, exits against the
oracle, the main job's plan and the report pages that carry them."""
import logging

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from conftest import ROOT, early_exit_parts  # noqa: E402
from specee.bench.oracle import exit_gap  # noqa: E402
from specee.decoding.base import generate_lockstep  # noqa: E402
from specee.decoding.dense import DenseDecoder  # noqa: E402
from specee.decoding.specee_ar import SpecEEDecoder  # noqa: E402
from specee.decoding.tree import TreeDecoder  # noqa: E402
from specee.early_exit.schedule import TwoLevelSchedule  # noqa: E402

K, L = 4, 6


@pytest.fixture(scope="module")
def parts():
    return early_exit_parts(L, K)


def _same(a, b):
    assert a.tokens == b.tokens and a.layers_run == b.layers_run
    strip = lambda tr: [{k: v for k, v in t.items() if not k.startswith("t_")} for t in tr]  # noqa: E731
    assert strip(a.trace) == strip(b.trace)


@pytest.mark.parametrize("flip", [False, True])
def test_lockstep_gives_each_decoder_the_generation_it_gives_alone(parts, flip):
    rt, draft, bank = parts
    sched = lambda: TwoLevelSchedule(L, [2, 3], True, 2, 1, False)  # noqa: E731
    decs = [DenseDecoder(rt), SpecEEDecoder(rt, draft, bank, k=K, kv_policy="holes", schedule=sched()),
            TreeDecoder(rt, draft, "small", bank=bank, schedule=sched(), mapping="merged", k=K, kv_policy="holes")]
    ids = torch.randint(1, 101, (1, 9), generator=torch.Generator().manual_seed(3))
    alone = [d.generate(ids, 20, None) for d in decs]
    together = generate_lockstep(decs, ids, 20, None, flip=flip)
    for a, b in zip(alone, together):
        _same(a, b)
        assert len(b.token_s) == len(b.tokens) and all(t > 0 for t in b.token_s)
    # An end of sequence stops each decoder where it stops alone.
    eos = alone[0].tokens[5]
    for a, b in zip([d.generate(ids, 20, eos) for d in decs], generate_lockstep(decs, ids, 20, eos, flip=flip)):
        _same(a, b)


def test_long_prompts_are_cut_said_once_and_the_library_warning_silenced(caplog):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    from specee.prompts import PromptEncoder
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i + 1 for i in range(50)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=32)
    enc = PromptEncoder(tokenizer, limit=32, max_new_tokens=8)
    long_text = " ".join(f"w{i % 50}" for i in range(40))
    with caplog.at_level(logging.WARNING):
        ids = enc(long_text, "p7")
        short = enc("w1 w2 w3", "p8")
    assert ids.shape[1] == 24 and ids[0, -1].item() == tokenizer(long_text, verbose=False).input_ids[-1]
    assert short.shape[1] == 3
    assert enc.record() == [{"id": "p7", "tokens": 40, "kept": 24}]
    assert "p7 (40 tokens)" in enc.note() and "last 24 tokens" in enc.note()
    assert not any("indexing errors" in r.getMessage() or "sequence length" in r.getMessage()
                   for r in caplog.records)
    enc(long_text, "p7")  # the same prompt again (a repeat) is one cut, not two
    assert len(enc.record()) == 1


def test_exit_gap_by_hand():
    # 6 tokens, 8 layers: at oracle, +1, +2, +5, never (full stack though layer 3 knew), earlier.
    used = [4, 5, 6, 8, 8, 2]
    oracle = [4, 4, 4, 3, 3, 5]
    g = exit_gap(used, oracle, 8)
    assert g["avg_layers_over_oracle"] == pytest.approx((33 / 6) / (23 / 6))
    assert g["share_at_oracle"] == pytest.approx(1 / 6)
    assert g["share_within_2"] == pytest.approx(2 / 6)
    assert g["share_later"] == pytest.approx(0)  # 8 vs 3 ran the full stack: that is "never"
    assert g["share_never"] == pytest.approx(2 / 6)
    assert g["share_earlier"] == pytest.approx(1 / 6)
    assert sum(g[k] for k in ("share_at_oracle", "share_within_2", "share_later", "share_never",
                              "share_earlier")) == pytest.approx(1)
    assert g["layers_over_oracle_histogram"] == {"-3": 1, "0": 1, "1": 1, "2": 1, "5": 2}
    # A token whose oracle is the last layer and that ran it is at the oracle, not "never".
    assert exit_gap([8], [8], 8)["share_at_oracle"] == 1.0
    assert exit_gap([], [], 8) == {}


def test_main_job_times_hf_generate_beside_dense_only():
    from hydra import compose, initialize_config_dir

    from experiments.reproduce import plan
    from specee.config import register
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["experiment=reproduce", "model=tiny"])  # the main job, as run.py composes it
    jobs = dict(plan(cfg))
    off = "experiment.compare_hf_generate=false"
    assert off not in jobs["speed_dense"] and not any(n.endswith("_compiled") for n in jobs)
    for name, args in jobs.items():
        if name.startswith("speed_") and not name.startswith("speed_dense"):
            assert off in args, name


def _speed(name, mode, speedup, ci, prompts, **extra):
    m = {"speedup_vs_dense": speedup, "speedup_vs_dense_ci": ci, "avg_layers": 28.0, "match_rate_vs_dense": 1.0,
         "tokens_per_s": 10.0 * speedup, "dense": {"tokens_per_s": 10.0, "speedup_vs_hf_generate": 1.2},
         "prompts": 2, **extra}
    return {"config": {"model": {"name": "tiny"}, "ablation": {"name": name, "mode": mode}, "early_exit": {},
                       "runtime": {"kind": "eager"}, "experiment": {"_target_": "experiments.speed.run"}},
            "env": {"cpu": "cpu", "gpus": []}, "created": "2026-12-02", "metrics": m, "prompts": prompts}


def _rows(cat, ids, ratio):
    return [{"id": i, "category": cat, "tokens": 11, "decode_s": 1.0, "dense_tokens": 11,
             "dense_decode_s": ratio} for i in ids]


def test_staircase_chains_hf_generate_through_dense_and_says_what_was_cut():
    from specee.report import fig_staircase
    cut = [{"id": "241", "tokens": 1380, "kept": 976}]
    dense = _speed("dense", "dense", 1.0, [0.98, 1.02], [], speedup_vs_hf_generate=1.2, truncated=cut)
    t1 = _speed("specee_t1", "specee", 1.5, [1.4, 1.6], [], truncated=cut,
                cost_model={"modelled_speedup_vs_dense": 1.55, "modelled_band": [1.5, 1.6],
                            "model_in_measured_ci": True, "measured_in_model_band": True, "unmodelled_share": 0.03,
                            "predicted_gpu": {"method": "analytic X", "speedup_vs_dense":
                                              {"llama2_7b": 1.3, "llama2_13b": 1.4}},
                            "gap_to_layer_ratio": [{"cost": "lm_head", "layer_units_per_token": 0.5}]})
    _, md = fig_staircase([dense, t1])
    row = next(line for line in md.splitlines() if line.startswith("| T1 |"))
    assert "| 1.550 [1.50, 1.60] | yes | 1.30 / 1.40 | lm_head 0.50 |" in row
    assert "| 1.800† |" in row  # 1.5 x the dense job's 1.2
    assert "1 of 2 prompts" in md and "prompt 241 (1380 tokens)" in md


def test_per_category_cells_carry_n_and_interval():
    from specee.report import fig_speedup_per_category
    d = _speed("specee_t1", "specee", 1.5, [1.4, 1.6], _rows("qa", ["a", "b", "c"], 2.0) + _rows("math", ["d"], 1.0))
    _, md = fig_speedup_per_category([d])
    qa = next(line for line in md.splitlines() if line.startswith("| qa |"))
    assert "2.00 [2.00, 2.00] n=3" in qa


def test_oracle_page_lists_each_early_exit_mode():
    from specee.report import fig_exit_vs_oracle
    gap = exit_gap([4, 5, 6, 8, 8, 2], [4, 4, 4, 3, 3, 5], 8)
    d = _speed("specee_t1_t2", "specee", 1.1, [1.0, 1.2], [], oracle_gap=gap, fire_precision=0.5,
               refuted_fires_per_token=0.8, cost_model={"units_us": {"layer": 100.0, "lm_head": 50.0}})
    _, md = fig_exit_vs_oracle([d])
    row = next(line for line in md.splitlines() if line.startswith("| specee_t1_t2 |"))
    assert f"| {gap['avg_layers_over_oracle']:.3f} |" in row and "| 0.800 | 0.40 |" in row


def test_lockstep_order_favours_no_side(parts):
    """Every side runs first, last and back to back in some rounds (a fixed reversal of three
    sides leaves the middle one never back to back, which biased it by 3 % in a real run)."""
    rt = parts[0]
    log = []

    class Logged(DenseDecoder):
        def __init__(self, rt, tag):
            super().__init__(rt)
            self.tag = tag

        def step(self, s):
            log.append(self.tag)
            return super().step(s)
    decs = [Logged(rt, t) for t in "abc"]
    ids = torch.randint(1, 101, (1, 5), generator=torch.Generator().manual_seed(0))
    generate_lockstep(decs, ids, 40, None)
    rounds = [log[i:i + 3] for i in range(0, len(log), 3)]
    for t in "abc":
        assert any(r[0] == t for r in rounds) and any(r[-1] == t for r in rounds)
        assert any(a == b == t for a, b in zip(log, log[1:]))
    log.clear()
    generate_lockstep(decs[:2], ids, 12, None)
    assert log[:6] == ["b", "a", "a", "b", "b", "a"]  # two sides: strict alternation of the order


def test_cost_model_page_lists_every_mode_with_measured_and_modelled():
    from specee.report import fig_cost_model
    cm = lambda v, ok: {"modelled_speedup_vs_dense": v, "modelled_band": [v - 0.05, v + 0.05],  # noqa: E731
                        "model_in_measured_ci": ok, "measured_in_model_band": ok, "unmodelled_share": 0.04,
                        "gap_to_layer_ratio": [{"cost": "predictor", "layer_units_per_token": 2.5}],
                        "predicted_gpu": {"method": "analytic X", "speedup_vs_dense": {"llama2_7b": 1.2,
                                                                                      "llama2_13b": 1.3}}}
    docs = [_speed("eagle", "eagle", 1.3, [1.2, 1.4], [], cost_model=cm(1.35, True)),
            _speed("adainfer", "adainfer", 0.9, [0.85, 0.95], [], cost_model=cm(1.0, False)),
            _speed("specee_t1", "specee", 0.9, [0.85, 0.95], [], cost_model={"failed": "RuntimeError: x"})]
    _, md = fig_cost_model(docs)
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    assert "| 1.300 [1.200, 1.400] | 1.350 [1.30, 1.40] | yes | +4.0% | predictor 2.50 | 1.20 / 1.30 |" in rows["eagle"]
    assert "| no |" in rows["adainfer"] and "specee_t1" not in rows  # a failed model is not drawn
