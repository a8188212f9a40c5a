"""Recipe: the draft head's reduced vocabulary — which tokens the model itself writes most often.

    python run.py experiment=draft_vocab model=smollm2_135m

Greedily continues the calibration prompts (disjoint from evaluation) with the base model, counts
the tokens it writes on four in five prompts, and reports on the fifth how much of what it writes
the N most frequent cover, for a range of N. Writes ``draft_vocab.json`` into the draft folder
(``experiment.out_dir``, default ``draft.path``) and a summary into its card; a speed or accuracy
run then reads it with ``draft.vocab_size=N`` (:mod:`specee.models.draft_vocab`).
"""
from __future__ import annotations

import json

from tqdm import tqdm

from specee import data, results
from specee.decoding.dense import DenseDecoder
from specee.errors import SpeceeError
from specee.io import project_path, write_json_atomic
from specee.models.draft_vocab import VOCAB_FILE, frequency_table
from specee.models.loader import load_model
from specee.prompts import PromptEncoder, format_conversation
from specee.runtime.layerwise import LayerwiseLM


def run(cfg) -> dict:
    e = cfg.experiment
    out = project_path(e.out_dir)
    if not out.is_dir():
        raise SpeceeError(f"experiment.out_dir={e.out_dir} is not a draft folder; train a draft head first "
                          "(experiment=train_draft) or point draft.path at one")
    model, tokenizer = load_model(cfg.model)
    rt = LayerwiseLM(model)
    decoder = DenseDecoder(rt)
    prompts, files = data.calibration_prompts(project_path(cfg.paths.data_root), e.calibration)
    every = max(2, round(1 / e.held_out_share)) if e.held_out_share > 0 else 0
    encode = PromptEncoder.for_runtime(tokenizer, rt, e.calibration.max_new_tokens)
    count_seqs, held_seqs, prompt_seqs, held_ids = [], [], [], []
    for i, p in enumerate(tqdm(prompts, desc="draft vocabulary")):
        text = format_conversation(cfg.model.chat_template, [(p.turns[0], None)], tokenizer)
        ids = encode(text, p.id)
        gen = decoder.generate(ids, e.calibration.max_new_tokens, tokenizer.eos_token_id)
        held = bool(every) and i % every == every - 1
        (held_seqs if held else count_seqs).append(list(gen.tokens))
        if held:
            held_ids.append(p.id)
        else:
            prompt_seqs.append(ids[0].tolist())
    if encode.note():
        print(f"note: {encode.note()}")
    if not sum(map(len, count_seqs)):
        raise SpeceeError("the calibration prompts produced no tokens to count; raise "
                          "experiment.calibration.max_new_tokens or add prompts")
    table = frequency_table(count_seqs, held_seqs, rt.lm_head.weight.shape[0], prompt_seqs)
    table.update({"model": cfg.model.name, "calibration_prompt_ids": [p.id for p in prompts],
                  "held_out_prompt_ids": held_ids, "data_files": files,
                  "max_new_tokens": e.calibration.max_new_tokens, "chat_template": cfg.model.chat_template,
                  "truncated": encode.record(),
                  "command": results.command_line(),
                  "method": "greedy continuations of the calibration prompts by the base model; ids it never "
                            "wrote ordered by their count in the counted prompts, then by id"})
    write_json_atomic(out / VOCAB_FILE, table)
    card_path = out / "draft_card.json"
    if card_path.is_file():  # the card says the folder now carries a frequency table
        card = json.loads(card_path.read_text())
        card["reduced_vocab_table"] = {k: table[k] for k in ("generated_tokens_counted", "distinct_generated",
                                                             "held_out_tokens", "held_out_coverage")}
        write_json_atomic(card_path, card)
    cov = ", ".join(f"N={n}: {c:.3f}" for n, c in table["held_out_coverage"].items() if c is not None)
    print(f"counted {table['generated_tokens_counted']} generated tokens ({table['distinct_generated']} distinct); "
          f"held-out coverage over {table['held_out_tokens']} tokens: {cov} -> {out / VOCAB_FILE}")
    metrics = {k: table[k] for k in ("generated_tokens_counted", "distinct_generated", "held_out_tokens",
                                     "held_out_coverage")}
    results.save(results.output_dir(), cfg, metrics)
    return metrics
