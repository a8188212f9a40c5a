"""The committed `tiny` artifacts: present, small, described, and as good as their cards say."""
import json

import pytest
import torch

from conftest import DATA_ROOT, ROOT, TINY
from specee import data

ART = ROOT / "specee" / "artifacts"


def test_tiny_is_deep_small_and_described():
    cfg = json.loads((TINY / "config.json").read_text())
    assert cfg["num_hidden_layers"] >= 24 and cfg["architectures"] == ["LlamaForCausalLM"]
    size = sum(f.stat().st_size for f in TINY.iterdir())
    assert size <= 30 * 2**20, f"tiny artifact is {size / 2**20:.1f} MB"
    card = json.loads((TINY / "model_card.json").read_text())
    for key in ("command", "seed", "steps", "tokens_seen", "loss_curve", "validation", "data", "samples"):
        assert key in card



def test_tiny_card_hashes_match_the_training_corpora():
    """The training corpora are not shipped; with SPECEE_DATA_ROOT pointing at a data root that
    holds them, the card's hashes must be theirs."""
    card = json.loads((TINY / "model_card.json").read_text())
    missing = [rel for rel in card["data"] if not (DATA_ROOT / rel).is_file()]
    if missing:
        pytest.skip(f"training corpora not under {DATA_ROOT} ({missing[0]}, ...); set SPECEE_DATA_ROOT "
                    "to a full data root to check the card's hashes")
    for rel, sha in card["data"].items():
        assert data.sha256(data.data_file(DATA_ROOT, rel)) == sha


def test_tiny_perplexity_matches_its_card(tiny):
    from experiments.train_base import validation_ppl
    model, tok = tiny
    card = json.loads((TINY / "model_card.json").read_text())
    stories = data.tinystories_valid(DATA_ROOT).documents[:40]
    ppl = validation_ppl(model, tok, stories, 256)
    # Same model, a subset of the card's 500 stories (bf16 weights run in float32 here).
    assert ppl < 1.5 * card["validation"]["val_ppl"], (ppl, card["validation"]["val_ppl"])
    assert ppl < 100, "tiny should model TinyStories far better than a unigram model"


@pytest.mark.parametrize("folder,card", [("tiny_draft", "draft_card.json"),
                                         ("tiny_predictors", "predictors_card.json"),
                                         ("tiny_adainfer", "adainfer_svm.json"),
                                         ("tiny_exit_profile", "exit_profile.json")])
def test_tiny_early_exit_artifacts_are_committed(folder, card):
    doc = json.loads((ART / folder / card).read_text())
    assert doc.get("num_layers", doc.get("base_num_layers", 24)) == json.loads(
        (TINY / "config.json").read_text())["num_hidden_layers"]


def test_tiny_draft_agrees_with_its_base(tiny):
    from specee.models.draft import load_draft
    from specee.runtime import LayerwiseLM
    model, tok = tiny
    rt = LayerwiseLM(model)
    draft, card = load_draft(ART / "tiny_draft", rt)
    ids = tok("Once upon a time, there was a little girl named Lily. She loved to play outside with her "
              "friends. One day, she found a big red ball in the park.", return_tensors="pt").input_ids
    with torch.inference_mode():
        f = rt.norm(rt.forward(ids, rt.new_cache()))
        guess = draft.logits(draft(ids[:, 1:], f[:, :-1])).topk(4, -1).indices[0, :-1]
        truth = rt.lm_head(f[:, 1:])[0, :-1].argmax(-1)
    top4 = (guess == truth[:, None]).any(-1).float().mean().item()
    assert top4 > 0.5, top4
