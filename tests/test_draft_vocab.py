"""The reduced draft vocabulary (draft.vocab_size=N): its table, its head, and lossless decoding with it."""
import json
import shutil

import pytest
import torch

from conftest import ROOT, TINY, early_exit_parts, run_cli
from specee.decoding.dense import DenseDecoder
from specee.decoding.tree import TreeDecoder
from specee.errors import SpeceeError
from specee.models.draft_vocab import (VOCAB_FILE, ReducedHead, coverage_of, frequency_table, read_table,
                                       reduced_ids)


def test_frequency_table_orders_by_generated_then_prompt_counts_and_reports_held_out_coverage():
    # generated: 5 x3, 2 x2, 7 x1; prompt-only: 9 x2, 3 x1; never seen: the rest, by id
    table = frequency_table([[5, 5, 2], [5, 2, 7]], [[5, 2, 9, 0]], vocab_size=12,
                            prompt_seqs=[[9, 9, 3]], sizes=(1, 3, 4))
    assert table["order"][:5] == [5, 2, 7, 9, 3]
    assert table["order"][5:] == [0, 1, 4, 6, 8, 10, 11]
    # held out 5, 2, 9, 0: top-1 {5} holds 1 of 4, top-3 {5,2,7} 2, top-4 adds 9: 3, all 12: 4
    assert table["held_out_coverage"] == {"1": 0.25, "3": 0.5, "4": 0.75, "12": 1.0}
    assert table["generated_tokens_counted"] == 6 and table["distinct_generated"] == 3
    assert coverage_of(table, 2) == pytest.approx(0.375)  # between the measured sizes 1 and 3


def _write(folder, table):
    (folder / VOCAB_FILE).write_text(json.dumps(table))


def test_read_table_refuses_missing_unreadable_and_foreign_tables(tmp_path):
    with pytest.raises(SpeceeError, match="experiment=draft_vocab"):
        read_table(tmp_path, 12)
    (tmp_path / VOCAB_FILE).write_bytes(bytes(range(256)) * 4)
    with pytest.raises(SpeceeError, match="not a readable frequency table"):
        read_table(tmp_path, 12)
    _write(tmp_path, [1, 2, 3])
    with pytest.raises(SpeceeError, match="format"):
        read_table(tmp_path, 12)
    table = frequency_table([[1, 2]], [], vocab_size=12)
    _write(tmp_path, table)
    with pytest.raises(SpeceeError, match="another vocabulary"):
        read_table(tmp_path, 13)
    _write(tmp_path, {**table, "order": table["order"][:-1] + [0]})  # a duplicate id
    with pytest.raises(SpeceeError, match="another vocabulary"):
        read_table(tmp_path, 12)
    _write(tmp_path, table)
    assert reduced_ids(read_table(tmp_path, 12), 2) == [1, 2]
    for bad in (0, 13):
        with pytest.raises(SpeceeError, match="draft.vocab_size"):
            reduced_ids(table, bad)


def test_reduced_head_proposes_the_top_k_of_the_full_head_within_the_subset():
    rt, draft, _ = early_exit_parts(layers=2)
    f = torch.randn(3, rt.config.hidden_size)
    ids = [7, 3, 50, 11, 99, 0, 42]
    got = ReducedHead(rt.lm_head, ids).topk(f, 4)
    full = rt.lm_head(f)
    mask = torch.full_like(full, float("-inf"))
    mask[:, ids] = 0
    assert torch.equal(got, (full + mask).topk(4, -1).indices)
    assert torch.equal(draft.topk(f, 4), full.topk(4, -1).indices)  # no reduction: the full head
    draft.restrict_vocab(ids)
    assert torch.equal(draft.topk(f, 4), got)


def test_eagle_with_a_reduced_draft_vocabulary_keeps_dense_tokens(tiny, tmp_path):
    """Verification stays over the full vocabulary, so what the draft may propose changes how many
    tokens are accepted, never which: EAGLE stays token-identical to dense greedy decoding."""
    from specee.models.draft import load_draft
    from specee.runtime.layerwise import LayerwiseLM
    model, tok = tiny
    rt = LayerwiseLM(model)
    folder = tmp_path / "draft"
    shutil.copytree(ROOT / "specee" / "artifacts" / "tiny_draft", folder)
    seqs = [tok("Once upon a time, a little girl").input_ids, tok("The cat sat on").input_ids]
    _write(folder, frequency_table(seqs, [], vocab_size=rt.lm_head.weight.shape[0]))
    draft, card = load_draft(folder, rt, vocab_size=64)
    assert card["reduced_vocab"]["size"] == 64 and len(draft.reduced) == 64
    ids = tok("Once upon a time, there was a", return_tensors="pt").input_ids
    dense = DenseDecoder(rt).generate(ids, 12).tokens
    full = TreeDecoder(rt, load_draft(TINY.parent / "tiny_draft", rt)[0], "small").generate(ids, 12)
    reduced = TreeDecoder(rt, draft, "small").generate(ids, 12)
    assert reduced.tokens == dense == full.tokens
    # a 64-token vocabulary cannot propose what the model writes outside it: fewer tokens per step
    assert len(reduced.trace) >= len(full.trace)


def test_vocab_size_refused_without_a_draft_or_beyond_the_vocabulary():
    r = run_cli("experiment=speed", "ablation=dense", "draft=none", "draft.vocab_size=8")
    assert r.returncode == 2 and "draft.vocab_size" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("experiment=speed", "ablation=eagle", "draft.vocab_size=99999")
    assert r.returncode == 2 and "exceeds the vocabulary" in r.stderr and "Traceback" not in r.stderr


def test_draft_vocab_recipe_writes_the_table_and_card(tmp_path):
    folder = tmp_path / "draft"
    shutil.copytree(ROOT / "specee" / "artifacts" / "tiny_draft", folder)
    r = run_cli("experiment=draft_vocab", "model=tiny", f"experiment.out_dir={folder}",
                "experiment.calibration.spec_bench_count=1", "experiment.calibration.story_prompts=4",
                "experiment.calibration.max_new_tokens=6", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-2000:]
    table = read_table(folder, 1536)
    counted = len(table["calibration_prompt_ids"]) - len(table["held_out_prompt_ids"])
    assert 0 < table["generated_tokens_counted"] <= 6 * counted  # up to 6 per counted prompt (EOS may stop one)
    assert table["held_out_prompt_ids"] and set(table["held_out_prompt_ids"]) < set(table["calibration_prompt_ids"])
    card = json.loads((folder / "draft_card.json").read_text())
    assert card["reduced_vocab_table"]["held_out_coverage"] == table["held_out_coverage"]
    assert json.loads((tmp_path / "run" / "results.json").read_text())["metrics"]["held_out_tokens"] > 0
