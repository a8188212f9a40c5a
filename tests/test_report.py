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
    assert "| 60.0 | 55.0 | -5.0 | – | – | 100 | [45.2, 64.8] | 25.50 / 32.00 |" in boolq  # no per-item records
    ppl = rows[("tinystories_ppl", "bits_per_byte (lower better)", "specee_t1_t2")]
    assert "| 1.400 | 1.450 | +0.050 | – | – | 20 | – | 24.00 / 32.00 |" in ppl
    assert not any(k[2] == "dense" for k in rows)  # dense is the reference column, not a row


def test_table_4_page_pairs_items_for_the_delta_interval_and_counts_changed_answers():
    m = {"primary_metric": "acc", "lower_is_better": False, "n": 8, "accuracy_stderr": 0.1}
    right = [1, 1, 1, 1, 0, 0, 1, 0]  # dense: 5 of 8
    mode = [1, 0, 1, 0, 0, 1, 1, 0]  # two lost (items 1, 3), one gained (item 5): 4 of 8
    items = lambda vals, answers: {"boolq": {str(i): {"value": float(v), "answer": a}  # noqa: E731
                                             for i, (v, a) in enumerate(zip(vals, answers))}}
    dense = doc("dense", "dense", {"boolq": {**m, "accuracy": 5 / 8}})
    dense["items"] = items(right, [0, 0, 0, 0, 1, 1, 0, 1])
    ee = doc("specee_t1_t2", "specee", {"boolq": {**m, "accuracy": 4 / 8}})
    ee["items"] = items(mode, [0, 1, 0, 1, 1, 0, 0, 0])  # item 7 changes its answer and stays wrong
    _, md = fig_accuracy([dense, ee])
    row = next(line for line in md.splitlines() if "| specee_t1_t2 |" in line)
    diff = [m_ - d for m_, d in zip(mode, right)]
    import statistics
    half = 1.96 * statistics.stdev(diff) / len(diff) ** 0.5 * 100
    assert f"| -12.5 | [{-12.5 - half:+.1f}, {-12.5 + half:+.1f}] | 4 (2 / 1) |" in row
    assert "published" not in md  # tiny has no published figures


def test_published_figures_sit_beside_dense_with_their_sources():
    m = {"primary_metric": "acc", "lower_is_better": False, "n": 200}
    dense = doc("dense", "dense", {"piqa": {**m, "accuracy": 0.6, "acc": 0.6, "acc_norm": 0.655,
                                            "acc_norm_stderr": 0.0336}})
    dense["config"]["model"]["name"] = "smollm2_135m"
    _, md = fig_accuracy([dense])
    assert "| piqa | 65.5 ± 6.6 (acc_norm) | 66.3 | card |" in md
    assert "| hellaswag | – (acc_norm) | 40.9 | card |" in md  # not evaluated: no value of ours
    assert "huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct" in md and "differs:" in md


def test_a_malformed_published_file_is_one_clear_error(tmp_path, monkeypatch):
    import pytest

    from specee.errors import SpeceeError
    from specee.evaluation import published
    (tmp_path / "m.json").write_text('{"model": "m", "sources": {"a": {}}, "tasks": {"piqa": [{"source": "b", '
                                     '"value": 1, "compare_with": "acc"}]}}')
    monkeypatch.setattr(published, "FOLDER", tmp_path)
    with pytest.raises(SpeceeError, match="task piqa has an entry without a known source"):
        published.load("m")
    assert published.load("absent") is None


def speed_doc(name, mode, kind, ms, eager_ms=None):
    m = {"ms_per_token": ms, "ms_per_token_over_limit": ms / 2.0, "speedup_vs_dense": 1.1, "efficiency": 0.9,
         "overhead_share": 0.1, "hf_generate_ratio": 0.8, "bandwidth_bound": {"limit_ms_per_token": 2.0},
         "avg_layers": 28.0, "match_rate_vs_dense": 1.0}
    if kind == "compiled":
        m |= {"speedup_vs_eager_dense": eager_ms / ms, "syncs_per_token": 9.0,
              "runtime": {"kind": "compiled", "compile_s": 12.5, "graphs_compiled_in_timed_runs": 0}}
    return {"config": {"model": {"name": "tiny"}, "ablation": {"name": name, "mode": mode}, "early_exit": {},
                       "runtime": {"kind": kind}, "experiment": {"_target_": "experiments.speed.run"}},
            "env": {"cpu": "cpu", "gpus": []}, "created": "2026-12-01", "metrics": m}


def test_runtime_page_puts_each_mode_on_eager_beside_compiled():
    from specee.report import fig_runtime
    from specee.report_pages.catalogue import display_name as _name
    docs = [speed_doc("dense", "dense", "eager", 20.0), speed_doc("dense", "dense", "compiled", 10.0, 20.0),
            speed_doc("specee_t1_t2", "specee", "eager", 18.0),
            speed_doc("specee_t1_t2", "specee", "compiled", 9.0, 20.0)]
    assert [_name(d) for d in docs] == ["dense", "dense (compiled)", "specee_t1_t2", "specee_t1_t2 (compiled)"]
    fig, md = fig_runtime(docs)
    rows = {line.split("|")[1].strip(): line for line in md.splitlines()[2:]}
    assert set(rows) == {"dense", "specee_t1_t2"}
    assert "| 20.0 (10.0×) | 10.0 (5.0×) | 2.000 |" in rows["dense"]
    assert "| 18.0 (9.0×) | 9.0 (4.5×) | 2.222 |" in rows["specee_t1_t2"]
    assert rows["dense"].rstrip().endswith("| 12.5 | 0 |")


def _speed_doc(name, mode, match, per_cat, model="tiny"):
    """A speed result whose prompts carry paired timings: per category (mode s/token, dense s/token)."""
    prompts = []
    for cat, (s_mode, s_dense) in per_cat.items():
        for i in range(3):
            prompts.append({"id": f"{cat}{i}", "category": cat, "tokens": 11, "decode_s": 10 * s_mode * (1 + i / 50),
                            "dense_tokens": 11, "dense_decode_s": 10 * s_dense})
    d = {"config": {"model": {"name": model}, "ablation": {"name": name, "mode": mode}, "early_exit": {},
                    "experiment": {"_target_": "experiments.speed.run"}},
         "env": {"cpu": "cpu", "gpus": [], "torch_threads": 2}, "created": "2026-12-04", "prompts": prompts,
         "metrics": {"speedup_vs_dense": 1.0, "speedup_vs_dense_ci": [0.9, 1.1], "match_rate_vs_dense": match,
                     "mean_accepted_length": 1.5}}
    return d


def test_which_method_page_names_the_fastest_lossless_method_per_category():
    from specee.report import fig_which_method
    docs = [_speed_doc("pld", "pld", 1.0, {"summarization": (0.8, 1.0), "writing": (1.2, 1.0)}),
            _speed_doc("hf_pld", "hf_pld", 1.0, {"summarization": (0.9, 1.0), "writing": (1.1, 1.0)}),
            _speed_doc("specee_t1_t2", "specee", 0.9, {"summarization": (0.5, 1.0), "writing": (0.9, 1.0)})]
    _, md = fig_which_method(docs)
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line for line in md.splitlines() if line.startswith("| tiny")}
    # summarization: pld at 1/0.8 (the lossy T1+T2 is faster still, listed beside with its match rate)
    summ = next(v for k, v in rows.items() if k[1] == "summarization")
    assert "| pld | 1.2" in summ and "| yes |" in summ and "specee_t1_t2 1.96 (0.900)" in summ
    # writing: no lossless method beats dense, so dense is the answer
    writing = next(v for k, v in rows.items() if k[1] == "writing")
    assert "| dense | 1.00 (the baseline) | – |" in writing
    assert "| pld (tiny) |" in md and "| hf_pld (tiny) |" in md  # the peer rows


def test_which_method_page_skips_without_a_peer_result():
    import pytest

    from specee.report import Skip, fig_which_method
    with pytest.raises(Skip, match="no speed results for any of"):
        fig_which_method([_speed_doc("specee_t1", "specee", 0.9, {"qa": (1.0, 1.0)})])


def test_a_not_applicable_peer_result_is_left_out_of_every_page():
    from specee.report import fig_which_method
    from specee.report_pages.catalogue import by_kind as _by_kind
    na = _speed_doc("hf_self_spec", "hf_self_spec", 1.0, {})
    na["metrics"] = {"not_applicable": "transformers cannot run hf_self_spec on this model: ValueError: ..."}
    ok = _speed_doc("pld", "pld", 1.0, {"qa": (0.8, 1.0)})
    assert _by_kind([na, ok], "speed") == [ok]
    _, md = fig_which_method([na, ok])
    assert "hf_self_spec" not in md and "| pld (tiny) |" in md


def test_staircase_puts_reduced_vocabulary_and_chosen_tree_beside_each_step():
    from specee.report import fig_staircase
    from specee.report_pages.catalogue import display_name as _name
    full = speed_doc("specee_t1_t2", "specee", "eager", 20.0)
    reduced = speed_doc("specee_t1_t2", "specee", "eager", 18.0)
    reduced["config"]["draft"] = {"vocab_size": 8192}
    tree = speed_doc("specee_full", "specee", "eager", 25.0)
    tree["config"]["ablation"] |= {"decoding": "tree", "mapping": "merged", "tree_select": "auto"}
    tuned = speed_doc("specee_t1_t2_tuned", "specee", "eager", 19.0)
    docs = [speed_doc("dense", "dense", "eager", 20.0), tree, reduced, tuned, full]
    assert _name(reduced) == "specee_t1_t2 (draft vocab 8192)" and _name(tree) == "specee_full (tree by cost)"
    _, md = fig_staircase(docs)
    steps = [line.split("|")[1].strip() for line in md.splitlines()[2:] if line.startswith("| ")]
    assert steps == ["dense", "T1+T2", "T1+T2 (draft vocab 8192)", "T1+T2 tuned", "T1+T2+T3 (tree by cost)"]
