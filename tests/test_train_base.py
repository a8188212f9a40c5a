import json

import pytest

from conftest import run_cli


def test_micro_training_recipe_lowers_loss_and_writes_a_loadable_artifact(tmp_path, train_data_root):
    out = tmp_path / "tiny_micro"
    res = run_cli("experiment=train_base", f"experiment.out_dir={out}", f"paths.data_root={train_data_root}",
                  f"experiment.checkpoint_dir={tmp_path / 'ckpt'}", "experiment.vocab_size=512",
                  "experiment.hidden_size=32", "experiment.intermediate_size=64",
                  "experiment.num_layers=2", "experiment.num_heads=2", "experiment.num_kv_heads=1",
                  "experiment.seq_len=32", "experiment.batch_size=8", "experiment.steps=60",
                  "experiment.warmup_steps=5", "experiment.lr=5e-3", "experiment.eval_every=30",
                  "experiment.eval_stories=3", "experiment.final_eval_stories=5",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-2000:]
    card = json.loads((out / "model_card.json").read_text())
    losses = [r["loss"] for r in card["loss_curve"]]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert card["steps"] == 60 and card["tokens_seen"] == 60 * 8 * 32
    assert all(len(sha) == 64 for sha in card["data"].values())
    assert card["validation"]["val_ppl"] > 1

    from omegaconf import OmegaConf
    from specee.config import ModelConfig
    from specee.models.loader import load_model
    model, tok = load_model(OmegaConf.structured(ModelConfig(name="micro", path=str(out))))
    assert model.config.num_hidden_layers == 2 and len(tok) == model.config.vocab_size
    assert not list(tmp_path.glob(".tiny_micro*")), "a temporary artifact folder was left behind"


@pytest.mark.slow
def test_interrupted_training_resumes_bit_for_bit(tmp_path, train_data_root):
    """A run stopped after its first step and resumed with the same command ends where an
    uninterrupted run ends: same loss at every step (weights, Adam state and both RNGs restored)."""
    micro = [f"paths.data_root={train_data_root}", "experiment.vocab_size=300", "experiment.hidden_size=32",
             "experiment.intermediate_size=64", "experiment.num_layers=2", "experiment.num_heads=2",
             "experiment.num_kv_heads=1", "experiment.seq_len=16", "experiment.batch_size=4", "experiment.steps=12",
             "experiment.warmup_steps=2", "experiment.eval_every=0", "experiment.final_eval_stories=2"]

    def train(name, *extra):
        res = run_cli("experiment=train_base", *micro, f"experiment.out_dir={tmp_path / name}",
                      f"experiment.checkpoint_dir={tmp_path / (name + '_ckpt')}", *extra,
                      f"hydra.run.dir={tmp_path / 'run' / name / str(len(extra))}")
        assert res.returncode == 0, res.stderr[-2000:]
        return res

    train("straight")
    first = train("resumed", "experiment.max_minutes=0.000001")  # stops after one step, checkpointed
    assert "stopping after 1 steps" in first.stdout
    again = train("resumed")
    assert "resuming from" in again.stdout and "at step 1" in again.stdout
    curve = lambda name: [(r["step"], r["loss"]) for r in  # noqa: E731
                          json.loads((tmp_path / name / "model_card.json").read_text())["loss_curve"]]
    assert curve("resumed") == curve("straight")
    card = json.loads((tmp_path / "resumed" / "model_card.json").read_text())
    assert card["resumed_at_steps"] == [1] and card["steps"] == 12


@pytest.mark.slow
def test_a_later_stage_continues_an_earlier_run(tmp_path, train_data_root):
    """init_from starts a new schedule from an earlier run's checkpoint: its weights (the loss goes on
    from where that run ended, not from a fresh model's), tokenizer and token count; the card lists
    both stages. A checkpoint of another shape is refused with one clear error."""
    micro = [f"paths.data_root={train_data_root}", "experiment.vocab_size=300", "experiment.hidden_size=32",
             "experiment.intermediate_size=64", "experiment.num_layers=2", "experiment.num_heads=2",
             "experiment.num_kv_heads=1", "experiment.seq_len=16", "experiment.batch_size=4",
             "experiment.warmup_steps=2", "experiment.lr=5e-3", "experiment.eval_every=0",
             "experiment.final_eval_stories=2"]

    def train(name, *extra):
        return run_cli("experiment=train_base", *micro, f"experiment.out_dir={tmp_path / name}",
                       f"experiment.checkpoint_dir={tmp_path / (name + '_ckpt')}", *extra,
                       f"hydra.run.dir={tmp_path / 'run' / name}")

    first = train("stage1", "experiment.steps=40")
    assert first.returncode == 0, first.stderr[-2000:]
    second = train("stage2", "experiment.steps=10", f"experiment.init_from={tmp_path / 'stage1_ckpt'}",
                   "experiment.autocast_dtype=bfloat16")
    assert second.returncode == 0, second.stderr[-2000:]
    c1 = json.loads((tmp_path / "stage1" / "model_card.json").read_text())
    c2 = json.loads((tmp_path / "stage2" / "model_card.json").read_text())
    start1 = sum(r["loss"] for r in c1["loss_curve"][:3]) / 3
    end1 = sum(r["loss"] for r in c1["loss_curve"][-3:]) / 3
    start2 = sum(r["loss"] for r in c2["loss_curve"][:3]) / 3
    assert start2 < start1 - 0.5 and abs(start2 - end1) < 0.5, (start1, end1, start2)
    assert [s["steps"] for s in c2["earlier_stages"]] == [40] and c2["steps"] == 10
    assert c2["tokens_seen"] == 50 * 4 * 16
    assert (tmp_path / "stage1" / "tokenizer.json").read_text() == (tmp_path / "stage2" / "tokenizer.json").read_text()
    assert "stage 1 of 2" in (tmp_path / "stage2" / "MODEL_CARD.md").read_text()

    wrong = train("wrong", "experiment.steps=2", "experiment.hidden_size=64",
                  f"experiment.init_from={tmp_path / 'stage1_ckpt'}")
    assert wrong.returncode != 0 and "another architecture" in wrong.stderr and "Traceback" not in wrong.stderr
