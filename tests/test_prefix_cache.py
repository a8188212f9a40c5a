"""The shared prompt prefix (the paper protocol's five shots) is prefilled once per task and its K/V
reused: every item's output and score is the one a whole prefill gives, for dense and for an
early-exit mode, through the generative protocol and through log-likelihood scoring."""
import json
import os

import pytest
import torch

from conftest import run_cli

from specee.evaluation.prefix import PrefixReuse, shared_length
from specee.runtime.layerwise import LayerwiseLM

os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")


def _run(tmp_path, ablation, reuse, tasks):
    out = tmp_path / f"{ablation}_{reuse}"
    res = run_cli("experiment=accuracy", "model=tiny", f"ablation={ablation}", f"experiment.tasks=[{tasks}]",
                  "experiment.limit=4", "threads=1", f"experiment.prefix_reuse={reuse}", f"hydra.run.dir={out}")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((out / "results.json").read_text())
    samples = {t: [json.loads(line) for line in (out / f"samples_{t}.jsonl").read_text().splitlines()]
               for t in tasks.split(",")}
    return doc, samples


@pytest.mark.parametrize("ablation", ["dense", "specee_t1_t2"])
def test_same_outputs_and_scores_with_and_without_prefix_reuse(tmp_path, ablation):
    tasks = "csqa_paper,copa"  # the paper's protocol (generation) and a log-likelihood task
    on, on_samples = _run(tmp_path, ablation, "true", tasks)
    off, off_samples = _run(tmp_path, ablation, "false", tasks)
    assert on["items"] == off["items"]  # per item: the metric's value and the chosen answer
    for task in tasks.split(","):
        for a, b in zip(on_samples[task], off_samples[task], strict=True):
            assert a["doc_id"] == b["doc_id"] and a["acc" if task == "copa" else "exact_match"] == \
                b["acc" if task == "copa" else "exact_match"]
            assert [r["mean_layers"] for r in a["specee"]] == [r["mean_layers"] for r in b["specee"]]
            if task == "csqa_paper":  # the written text, token for token, and its parsed letter
                assert a["resps"] == b["resps"] and a["filtered_resps"] == b["filtered_resps"]
            else:  # log-likelihoods: float32 sums over another split of the prompt, not bit for bit
                for (x,), (y,) in zip(a["resps"], b["resps"], strict=True):
                    assert x[1] == y[1] and x[0] == pytest.approx(y[0], abs=1e-4)
        for key in ("accuracy", "n", "mean_layers"):
            assert on["metrics"]["accuracy"][task][key] == off["metrics"]["accuracy"][task][key]
    saved = on["metrics"]["prefix_reuse"]
    # the five shots were prefilled once: later items ran only their own tokens
    assert saved["reused_tokens"] > saved["prefilled_tokens"] > 0
    assert "prefix_reuse" not in off["metrics"]


def test_reuse_is_exact_ids_only_and_restores_the_runtime(tiny):
    model, _ = tiny
    rt = LayerwiseLM(model)
    reuse = PrefixReuse(rt, min_shared=4)
    shots = list(range(5, 45))
    a, b, c = shots + [50, 51, 52], shots + [60, 61], [7] + shots[1:] + [50]
    with torch.inference_mode(), reuse.active():
        for ids in (a, b, c):
            rt.forward(torch.tensor([ids]), rt.new_cache(64))
    # b shares the 40 shot tokens with a; c differs at its first token: nothing reused
    assert reuse.reused_tokens == len(shots) and reuse.prefilled_tokens == len(a) + 2 + len(c)
    assert "forward" not in vars(rt)  # the runtime's own method again
    with torch.inference_mode():
        whole = rt.forward(torch.tensor([b]), rt.new_cache(64))
        with reuse.active():
            rt.forward(torch.tensor([a]), rt.new_cache(64))
            part = rt.forward(torch.tensor([b]), rt.new_cache(64))
    assert torch.allclose(whole, part, atol=1e-5)
    assert shared_length([1, 2, 3], [1, 2, 4]) == 2 and shared_length([], [1]) == 0
