import json

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
