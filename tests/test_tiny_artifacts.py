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
    # Llama-2-7B's proportions: full multi-head attention, MLP ~2.7x, LM head ~0.65 of a layer.
    d = cfg["hidden_size"]
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"] and not cfg["tie_word_embeddings"]
    assert 2.4 <= cfg["intermediate_size"] / d <= 3.0
    layer = 4 * d * d + 3 * d * cfg["intermediate_size"] + 2 * d
    assert 0.55 <= cfg["vocab_size"] * d / layer <= 0.8, cfg["vocab_size"] * d / layer
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


def test_tiny_bits_per_byte_match_its_card(tiny):
    from experiments.train_base import validation_bits_per_byte
    model, tok = tiny
    card = json.loads((TINY / "model_card.json").read_text())
    stories = data.tinystories_valid(DATA_ROOT).documents[:40]
    bpb = validation_bits_per_byte(model, tok, stories, 256)
    # Same model, a subset of the card's 500 stories (bf16 weights run in float32 here).
    assert bpb < 1.15 * card["validation"]["val_bits_per_byte"], (bpb, card["validation"])
    assert bpb < 2.0, "tiny should model TinyStories far better than a unigram model (~4.5 bits/byte)"


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
    from specee.runtime.layerwise import LayerwiseLM
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
