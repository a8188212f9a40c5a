"""Recipe: train the embedded `tiny` reference model (tokenizer + LlamaForCausalLM) from scratch.

    python run.py experiment=train_base                      # the committed artifact's recipe
    python run.py experiment=train_base experiment.steps=20 experiment.hidden_size=32 ...

Writes ``out_dir`` atomically: bf16 safetensors, tokenizer, ``model_card.json`` (data files and
their sha256, command, seed, steps, tokens, loss curve, validation perplexity) and ``MODEL_CARD.md``.
"""
from __future__ import annotations

import json
import math
import random
import time

import torch
from omegaconf import OmegaConf
from tqdm import tqdm
from transformers import LlamaForCausalLM

from specee import data, results
from specee.errors import SpeceeError
from specee.io import atomic_dir, project_path
from specee.models.builders import EOS, tiny_config, train_tokenizer


def _token_stream(tokenizer, docs: list[str]) -> torch.Tensor:
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for d in docs:
        ids.extend(tokenizer(d, add_special_tokens=False)["input_ids"])
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def validation_ppl(model, tokenizer, stories: list[str], seq_len: int) -> float:
    """Token-level perplexity over whole stories (each starts after an EOS, split into seq_len windows)."""
    model.eval()
    eos = tokenizer.convert_tokens_to_ids(EOS)
    nll, count = 0.0, 0
    for s in stories:
        ids = [eos] + tokenizer(s, add_special_tokens=False)["input_ids"] + [eos]
        for start in range(0, len(ids) - 1, seq_len):
            chunk = torch.tensor(ids[start:start + seq_len + 1]).unsqueeze(0)
            if chunk.shape[1] < 2:
                continue
            logits = model(input_ids=chunk[:, :-1]).logits.float()
            nll += torch.nn.functional.cross_entropy(
                logits[0], chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
    model.train()
    return math.exp(nll / count)


def _lr(step: int, e) -> float:
    if step < e.warmup_steps:
        return e.lr * (step + 1) / e.warmup_steps
    frac = (step - e.warmup_steps) / max(1, e.steps - e.warmup_steps)
    return e.lr * (e.min_lr_ratio + (1 - e.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def run(cfg) -> dict:
    e = cfg.experiment
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    root = project_path(cfg.paths.data_root)
    stories = data.tinystories_train(root)
    books = data.children_books(root)
    valid = data.tinystories_valid(root)

    tokenizer = train_tokenizer(stories.documents + books.documents, e.vocab_size)
    streams = {"tinystories": _token_stream(tokenizer, stories.documents),
               "children_books_pg": _token_stream(tokenizer, books.documents)}
    eos = tokenizer.convert_tokens_to_ids(EOS)
    config = tiny_config(len(tokenizer), e.hidden_size, e.intermediate_size, e.num_layers,
                         e.num_heads, e.num_kv_heads, eos_token_id=eos)
    model = LlamaForCausalLM(config)
    _scale_residual_init(model, config.num_hidden_layers)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=e.lr, betas=(0.9, 0.95),
                            weight_decay=e.weight_decay)

    def batch() -> torch.Tensor:
        rows = []
        for _ in range(e.batch_size):
            src = "tinystories" if rng.random() < e.tinystories_share else "children_books_pg"
            s = streams[src]
            i = rng.randrange(0, len(s) - e.seq_len - 1)
            rows.append(s[i:i + e.seq_len + 1])
        return torch.stack(rows)

    val_small = valid.documents[: e.eval_stories]
    curve, evals = [], []
    t0 = time.perf_counter()
    model.train()
    steps_done = 0
    skipped: list[int] = []
    bar = tqdm(range(e.steps), desc="train tiny", dynamic_ncols=True)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr(step, e)
        b = batch()
        loss = _loss(model, b)
        steps_done = step + 1  # counted even when a non-finite update is skipped
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), e.grad_clip)
        if not (torch.isfinite(loss) and torch.isfinite(gnorm)):
            # A rare non-finite batch: skip its update (counted in the card) rather than poison Adam.
            skipped.append(step + 1)
            tqdm.write(f"step {step + 1}: non-finite loss/gradient, update skipped")
            if len(skipped) > e.max_skipped_steps:
                raise SpeceeError(f"training diverged ({len(skipped)} non-finite steps, last at "
                                  f"{step + 1}); lower experiment.lr or raise experiment.warmup_steps")
            continue
        opt.step()
        curve.append({"step": steps_done, "loss": round(loss.item(), 4),
                      "elapsed_s": round(time.perf_counter() - t0, 1)})
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if e.eval_every and steps_done % e.eval_every == 0:
            ppl = validation_ppl(model, tokenizer, val_small, e.seq_len)
            evals.append({"step": steps_done, "val_ppl": round(ppl, 2)})
            tqdm.write(f"step {steps_done}: val ppl ({len(val_small)} stories) {ppl:.1f}")
        if e.max_minutes and time.perf_counter() - t0 > 60 * e.max_minutes:
            tqdm.write(f"stopping after {steps_done} steps: max_minutes={e.max_minutes} reached")
            break
    train_s = time.perf_counter() - t0
    final_stories = valid.documents[: e.final_eval_stories]
    final_ppl = validation_ppl(model, tokenizer, final_stories, e.seq_len)

    card_samples = samples(model, tokenizer)
    model.config.dtype = e.save_dtype
    model = model.to(getattr(torch, e.save_dtype))
    card = {
        "model": "tiny", "architecture": "LlamaForCausalLM", "parameters": n_params,
        "config": {k: getattr(config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings")},
        "command": results.command_line(),
        "recipe": OmegaConf.to_container(e, resolve=True),
        "seed": cfg.seed,
        "data": {**stories.files, **books.files},
        "validation": {"file": data.TINYSTORIES_VALID, "sha256": valid.files[data.TINYSTORIES_VALID],
                       "stories": len(final_stories), "val_ppl": round(final_ppl, 3)},
        "steps": steps_done, "steps_planned": e.steps, "skipped_nonfinite_steps": skipped,
        "tokens_seen": steps_done * e.batch_size * e.seq_len,
        "train_tokens_available": {k: int(v.numel()) for k, v in streams.items()},
        "train_seconds": round(train_s, 1), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "saved_dtype": e.save_dtype,
        "val_curve": evals,
        "samples": card_samples,
        "loss_curve": curve[:: max(1, len(curve) // 200)] + curve[-1:],
    }
    out = project_path(e.out_dir)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "model_card.json").write_text(json.dumps(card, indent=1))
        (tmp / "MODEL_CARD.md").write_text(_card_markdown(card))
    print(f"saved {out}  (val ppl {final_ppl:.1f} on {len(final_stories)} stories, "
          f"{steps_done} steps, {train_s / 60:.1f} min)")
    return card


SAMPLE_PROMPTS = ["Once upon a time, there was a little girl named Lily. She",
                  "Tom and his dog went to the park. They",
                  "The little bird was sad because"]


@torch.no_grad()
def samples(model, tokenizer, n_new: int = 40) -> list[dict]:
    """Greedy continuations of TinyStories-style prompts, for the model card."""
    model.eval()
    out = []
    for p in SAMPLE_PROMPTS:
        ids = tokenizer(p, return_tensors="pt").input_ids
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        out.append({"prompt": p, "greedy_continuation": tokenizer.decode(gen[0, ids.shape[1]:],
                                                                          skip_special_tokens=True)})
    return out


def _scale_residual_init(model, num_layers: int) -> None:
    """GPT-2 style: residual-branch outputs start at std 0.02/sqrt(2L), which keeps a deep, narrow
    stack from blowing up early in training."""
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                lin.weight.normal_(0.0, 0.02 / math.sqrt(2 * num_layers))


def _loss(model, b: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=b[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             b[:, 1:].reshape(-1))


def _card_markdown(card: dict) -> str:
    lines = [
        "# tiny — specee's embedded reference model", "",
        f"A {card['config']['num_hidden_layers']}-layer Llama-architecture causal LM "
        f"({card['parameters'] / 1e6:.1f} M parameters, width {card['config']['hidden_size']}, "
        f"vocab {card['config']['vocab_size']} byte-level BPE), trained from scratch by specee on "
        "TinyStories and public-domain children's books. It exists so that every code path runs "
        "on a CPU without a model hub; it is not a useful assistant.", "",
        f"- command: `{card['command']}` (seed {card['seed']})",
        f"- steps: {card['steps']} of {card['steps_planned']} planned, tokens seen: {card['tokens_seen']:,}, "
        f"train time {card['train_seconds'] / 60:.1f} min on {card['threads']} CPU threads",
        f"- validation perplexity: **{card['validation']['val_ppl']}** on the first "
        f"{card['validation']['stories']} stories of `{card['validation']['file']}`",
        f"- weights saved as {card['saved_dtype']} safetensors", "",
        "## Validation perplexity during training", "", "| step | val ppl |", "|---|---|",
        *[f"| {r['step']} | {r['val_ppl']} |" for r in card["val_curve"]], "",
        "## Greedy samples", "",
        *[f"- *{r['prompt']}* → {r['greedy_continuation']!r}" for r in card.get("samples", [])], "",
        "## Training data (sha256)", "",
        *[f"- `{k}` `{v}`" for k, v in card["data"].items()], "",
        "The full loss curve is in `model_card.json`.", "",
    ]
    return "\n".join(lines)
