"""Report pages from results documents (the layout; the numbers come from the documents)."""
import matplotlib

matplotlib.use("Agg")

from specee.report import fig_accuracy  # noqa: E402


def doc(name, mode, tasks, hw="cpu"):
    return {"config": {"model": {"name": "tiny"}, "ablation": {"name": name, "mode": mode},
                       "early_exit": {}}, "env": {"cpu": hw, "gpus": []}, "created": "2026-12-01",
            "metrics": {"accuracy": tasks}}


def test_table_4_page_puts_dense_beside_each_mode_with_delta_n_interval_and_layers():
    dense = doc("dense", "dense", {
        "boolq": {"accuracy": 0.60, "accuracy_stderr": 0.05, "n": 100, "mean_layers": 32.0,
                  "primary_metric": "acc", "lower_is_better": False},
        "tinystories_ppl": {"accuracy": 1.400, "accuracy_stderr": None, "n": 20, "mean_layers": 32.0,
                            "primary_metric": "bits_per_byte", "lower_is_better": True}})
    ee = doc("specee_t1_t2", "specee", {
        "boolq": {"accuracy": 0.55, "accuracy_stderr": 0.05, "n": 100, "mean_layers": 25.5,
                  "primary_metric": "acc", "lower_is_better": False},
        "tinystories_ppl": {"accuracy": 1.450, "accuracy_stderr": None, "n": 20, "mean_layers": 24.0,
                            "primary_metric": "bits_per_byte", "lower_is_better": True}})
    fig, md = fig_accuracy([dense, ee])
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line for line in md.splitlines()[2:]}
    boolq = rows[("boolq", "acc (%)", "specee_t1_t2")]
    assert "| 60.0 | 55.0 | -5.0 | 100 | [45.2, 64.8] | 25.50 / 32.00 |" in boolq
    ppl = rows[("tinystories_ppl", "bits_per_byte (lower better)", "specee_t1_t2")]
    assert "| 1.400 | 1.450 | +0.050 | 20 | – | 24.00 / 32.00 |" in ppl
    assert not any(k[2] == "dense" for k in rows)  # dense is the reference column, not a row
