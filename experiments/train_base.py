"""Recipe: train the embedded `tiny` reference model (tokenizer + LlamaForCausalLM) from scratch.

    python run.py experiment=train_base                      # the committed artifact's recipe
    python run.py experiment=train_base experiment.steps=20 experiment.hidden_size=32 ...

Training checkpoints to ``checkpoint_dir`` every ``checkpoint_minutes``; the same command, run
again, resumes from the last checkpoint (the recipe must match; ``force=true`` starts over).
A later stage (``init_from=<checkpoint folder of an earlier run>``) continues that run's weights,
tokenizer, Adam moments and RNG streams under a new schedule; the card lists every stage.
Writes ``out_dir`` atomically: bf16 safetensors, tokenizer, ``model_card.json`` (data files and
their sha256, command, seed, steps, tokens, loss curve, validation perplexity) and ``MODEL_CARD.md``.
"""
from __future__ import annotations

import json
import math
import random
import shutil
import time

import torch
from omegaconf import OmegaConf
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

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


@torch.no_grad()
def validation_bits_per_byte(model, tokenizer, stories: list[str], seq_len: int) -> float:
    """Bits per UTF-8 byte of the stories' text (tokenizer-independent, so models with different
    vocabularies compare): the summed next-token NLL of each story's tokens, each story read after
    an EOS in seq_len windows, over the stories' byte count. The closing EOS is not scored."""
    model.eval()
    eos = tokenizer.convert_tokens_to_ids(EOS)
    nll, n_bytes = 0.0, 0
    for s in stories:
        ids = [eos] + tokenizer(s, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - 1, seq_len):
            chunk = torch.tensor(ids[start:start + seq_len + 1]).unsqueeze(0)
            if chunk.shape[1] < 2:
                continue
            logits = model(input_ids=chunk[:, :-1]).logits.float()
            nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        n_bytes += len(s.encode("utf-8"))
    model.train()
    return nll / math.log(2) / n_bytes


def _lr(step: int, e) -> float:
    if step < e.warmup_steps:
        return e.lr * (step + 1) / e.warmup_steps
    frac = (step - e.warmup_steps) / max(1, e.steps - e.warmup_steps)
    return e.lr * (e.min_lr_ratio + (1 - e.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


_RESUME_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "seq_len", "batch_size", "steps", "lr", "min_lr_ratio", "warmup_steps",
                "weight_decay", "grad_clip", "tinystories_share", "init_from", "autocast_dtype")
_ARCH_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")


def _save_checkpoint(ckpt_dir, model, opt, tokenizer, rng, state: dict) -> None:
    """Everything needed to continue bit-for-bit: weights, Adam moments, both RNGs, the curves."""
    tmp = ckpt_dir.with_name(f".{ckpt_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "torch_rng": torch.get_rng_state(), "py_rng": rng.getstate()}, tmp / "state.pt")
    tokenizer.save_pretrained(tmp)
    (tmp / "progress.json").write_text(json.dumps(state, indent=1))
    old = ckpt_dir.with_name(f".{ckpt_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if ckpt_dir.exists():
        ckpt_dir.rename(old)
    tmp.rename(ckpt_dir)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(ckpt_dir, recipe: dict):
    """The checkpoint in ckpt_dir if it belongs to this recipe; a clear error if it does not."""
    if not (ckpt_dir / "progress.json").is_file():
        return None
    try:
        state = json.loads((ckpt_dir / "progress.json").read_text())
        blob = torch.load(ckpt_dir / "state.pt", weights_only=True)  # never runs code a checkpoint folder carries
        tokenizer = PreTrainedTokenizerFast.from_pretrained(ckpt_dir)
    except Exception as err:  # noqa: BLE001 - any unreadable checkpoint gets the same advice
        raise SpeceeError(f"training checkpoint {ckpt_dir} is unreadable ({type(err).__name__}: {err}); "
                          "delete it or pass force=true to start over") from None
    if recipe is None:
        return state, blob, tokenizer
    theirs = {k: state["recipe"].get(k) for k in _RESUME_KEYS}
    ours = {k: recipe.get(k) for k in _RESUME_KEYS}
    if theirs != ours:
        diff = {k: (theirs[k], ours[k]) for k in _RESUME_KEYS if theirs[k] != ours[k]}
        raise SpeceeError(f"training checkpoint {ckpt_dir} was made by another recipe "
                          f"(checkpoint vs now: {diff}); rerun with the same settings, or force=true to start over")
    return state, blob, tokenizer


def _earlier_stages(init_dir, recipe: dict):
    """The checkpoint an ``init_from`` stage starts from, with the stages that made it."""
    if not (init_dir / "progress.json").is_file():
        raise SpeceeError(f"experiment.init_from={init_dir} holds no train_base checkpoint (progress.json); "
                          "point it at the checkpoint_dir of a finished earlier run")
    state, blob, tokenizer = _load_checkpoint(init_dir, None)
    theirs = {k: state["recipe"].get(k) for k in _ARCH_KEYS}
    ours = {k: recipe.get(k) for k in _ARCH_KEYS}
    if theirs != ours:
        diff = {k: (theirs[k], ours[k]) for k in _ARCH_KEYS if theirs[k] != ours[k]}
        raise SpeceeError(f"experiment.init_from={init_dir} is another architecture (checkpoint vs now: {diff}); "
                          "a later stage keeps the model's shape")
    seq, bs = state["recipe"]["seq_len"], state["recipe"]["batch_size"]
    this = {"recipe": state["recipe"], "command": state.get("command"), "steps": state["step"], "tokens_seen": state["step"] * seq * bs,
            "train_seconds": round(state["train_seconds"], 1), "skipped_nonfinite_steps": state["skipped"],
            "resumed_at_steps": state["resumed_at"], "val_curve": state["evals"]}
    return state.get("earlier_stages", []) + [this], blob, tokenizer


def run(cfg) -> dict:
    e = cfg.experiment
    recipe = OmegaConf.to_container(e, resolve=True)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    root = project_path(cfg.paths.data_root)
    stories = data.tinystories_train(root)
    books = data.children_books(root)
    valid = data.tinystories_valid(root)
    ckpt_dir = project_path(e.checkpoint_dir)
    if cfg.force:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    resumed = _load_checkpoint(ckpt_dir, recipe)
    init = None
    if resumed:
        state, blob, tokenizer = resumed
    else:
        state = {"recipe": recipe, "step": 0, "train_seconds": 0.0, "curve": [], "evals": [],
                 "skipped": [], "resumed_at": [], "earlier_stages": [], "command": results.command_line()}
        if e.init_from:
            state["earlier_stages"], blob, tokenizer = init = _earlier_stages(project_path(e.init_from), recipe)
        else:
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
    if resumed:
        model.load_state_dict(blob["model"])
        opt.load_state_dict(blob["optimizer"])
        torch.set_rng_state(blob["torch_rng"])
        rng.setstate(_as_rng_state(blob["py_rng"]))
        state["resumed_at"].append(state["step"])
        print(f"resuming from {ckpt_dir} at step {state['step']} "
              f"({state['train_seconds'] / 60:.1f} min trained so far)", flush=True)
    elif init:
        model.load_state_dict(blob["model"])
        opt.load_state_dict(blob["optimizer"])  # Adam moments carry over; the schedule sets lr each step
        torch.set_rng_state(blob["torch_rng"])
        rng.setstate(_as_rng_state(blob["py_rng"]))  # continue the data stream, don't replay it
        print(f"stage {len(state['earlier_stages']) + 1}: starting from {e.init_from} "
              f"({sum(s['steps'] for s in state['earlier_stages'])} earlier steps)", flush=True)
    autocast = getattr(torch, e.autocast_dtype) if e.autocast_dtype else None

    def batch() -> torch.Tensor:
        rows = []
        for _ in range(e.batch_size):
            src = "tinystories" if rng.random() < e.tinystories_share else "children_books_pg"
            s = streams[src]
            i = rng.randrange(0, len(s) - e.seq_len - 1)
            rows.append(s[i:i + e.seq_len + 1])
        return torch.stack(rows)

    def save() -> None:
        _save_checkpoint(ckpt_dir, model, opt, tokenizer, rng, state)

    val_small = valid.documents[: e.eval_stories]
    tokens_per_step = e.batch_size * e.seq_len
    model.train()
    t_session = time.perf_counter()
    t_base = state["train_seconds"]  # time trained before this process (resume)
    t_ckpt = t_session
    first_step = state["step"]
    stopped_early = False
    for step in range(first_step, e.steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, e)
        b = batch()
        loss = _loss(model, b, autocast)
        state["step"] = step + 1  # counted even when a non-finite update is skipped
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), e.grad_clip)
        now = time.perf_counter()
        state["train_seconds"] = t_base + (now - t_session)
        if not (torch.isfinite(loss) and torch.isfinite(gnorm)):
            # A rare non-finite batch: skip its update (counted in the card) rather than poison Adam.
            state["skipped"].append(step + 1)
            print(f"step {step + 1}: non-finite loss/gradient, update skipped", flush=True)
            if len(state["skipped"]) > e.max_skipped_steps:
                raise SpeceeError(f"training diverged ({len(state['skipped'])} non-finite steps, last at "
                                  f"{step + 1}); lower experiment.lr or raise experiment.warmup_steps")
            continue
        opt.step()
        done = step + 1
        state["curve"].append({"step": done, "loss": round(loss.item(), 4),
                               "elapsed_s": round(state["train_seconds"], 1)})
        if done % e.log_every == 0 or done == e.steps:
            rate = (done - first_step) * tokens_per_step / max(1e-9, now - t_session)
            eta_min = (e.steps - done) * tokens_per_step / max(rate, 1e-9) / 60
            print(f"step {done}/{e.steps}  loss {loss.item():.3f}  lr {_lr(step, e):.2e}  "
                  f"{rate:,.0f} tok/s  elapsed {state['train_seconds'] / 60:.1f} min  "
                  f"ETA {eta_min:.1f} min", flush=True)
        if e.eval_every and done % e.eval_every == 0:
            bpb = validation_bits_per_byte(model, tokenizer, val_small, e.seq_len)
            state["evals"].append({"step": done, "val_bpb": round(bpb, 4)})
            print(f"step {done}: validation bits/byte ({len(val_small)} stories) {bpb:.4f}", flush=True)
        if e.max_minutes and state["train_seconds"] > 60 * e.max_minutes:
            print(f"stopping after {done} steps: max_minutes={e.max_minutes} reached", flush=True)
            stopped_early = True
            break
        if e.checkpoint_minutes and time.perf_counter() - t_ckpt > 60 * e.checkpoint_minutes:
            save()
            t_ckpt = time.perf_counter()
            print(f"checkpoint at step {done} -> {ckpt_dir}", flush=True)
    if e.checkpoint_minutes:
        save()  # a crash in the final evaluation must not cost the training
    steps_done = state["step"]
    final_stories = valid.documents[: e.final_eval_stories]
    final_ppl = validation_ppl(model, tokenizer, final_stories, e.seq_len)
    final_bpb = validation_bits_per_byte(model, tokenizer, final_stories, e.seq_len)

    card_samples = samples(model, tokenizer)
    model.config.dtype = e.save_dtype
    model = model.to(getattr(torch, e.save_dtype))
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters())
    card = {
        "model": "tiny", "architecture": "LlamaForCausalLM", "parameters": n_params,
        "config": {k: getattr(config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings")},
        "cost_structure": {"params_per_layer": layer_params,
                           "lm_head_params": model.lm_head.weight.numel(),
                           "lm_head_over_layer": round(model.lm_head.weight.numel() / layer_params, 3)},
        "command": results.command_line(),
        "recipe": recipe,
        "seed": cfg.seed,
        "data": {**stories.files, **books.files},
        "validation": {"file": data.TINYSTORIES_VALID, "sha256": valid.files[data.TINYSTORIES_VALID],
                       "stories": len(final_stories), "val_ppl": round(final_ppl, 3),
                       "val_bits_per_byte": round(final_bpb, 4)},
        "steps": steps_done, "steps_planned": e.steps, "stopped_early": stopped_early,
        "skipped_nonfinite_steps": state["skipped"], "resumed_at_steps": state["resumed_at"],
        "earlier_stages": state.get("earlier_stages", []),
        "tokens_seen": steps_done * tokens_per_step + sum(s["tokens_seen"] for s in state.get("earlier_stages", [])),
        "train_tokens_available": {k: int(v.numel()) for k, v in streams.items()},
        "train_seconds": round(state["train_seconds"], 1), "threads": torch.get_num_threads(),
        "train_seconds_all_stages": round(state["train_seconds"] + sum(
            s["train_seconds"] for s in state.get("earlier_stages", [])), 1),
        "torch": torch.__version__, "saved_dtype": e.save_dtype,
        "val_curve": state["evals"],
        "samples": card_samples,
        "loss_curve": state["curve"][:: max(1, len(state["curve"]) // 200)] + state["curve"][-1:],
    }
    out = project_path(e.out_dir)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "model_card.json").write_text(json.dumps(card, indent=1))
        (tmp / "MODEL_CARD.md").write_text(_card_markdown(card))
    print(f"saved {out}  (val {final_bpb:.4f} bits/byte, ppl {final_ppl:.1f} on {len(final_stories)} "
          f"stories, {steps_done} steps, {state['train_seconds'] / 60:.1f} min)", flush=True)
    return card


def _as_rng_state(st):
    """random.setstate needs tuples; a state that went through torch.save may hold lists."""
    return (st[0], tuple(st[1]), st[2])


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


def _loss(model, b: torch.Tensor, autocast=None) -> torch.Tensor:
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = model(input_ids=b[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             b[:, 1:].reshape(-1))


def _card_markdown(card: dict) -> str:
    c = card["config"]
    v = card["validation"]
    cost = card.get("cost_structure", {})
    attn = ("full multi-head attention" if c["num_key_value_heads"] == c["num_attention_heads"]
            else f"grouped-query attention {c['num_attention_heads']}/{c['num_key_value_heads']}")
    lines = [
        "# tiny — specee's embedded reference model", "",
        f"A {c['num_hidden_layers']}-layer Llama-architecture causal LM "
        f"({card['parameters'] / 1e6:.1f} M parameters, width {c['hidden_size']}, MLP "
        f"{c['intermediate_size']}, {attn}, vocab {c['vocab_size']} byte-level BPE), trained from "
        "scratch by specee on TinyStories and public-domain children's books. It exists so that every "
        "code path runs on a CPU without a model hub; it is not a useful assistant.", "",
        f"- command: `{card['command']}` (seed {card['seed']}), with `paths.data_root` pointing at a data "
        "root that holds the training corpora below (not shipped; see the README)",
        f"- steps: {card['steps']} of {card['steps_planned']} planned, tokens seen (all stages): {card['tokens_seen']:,}, "
        f"train time {card['train_seconds'] / 60:.1f} min on {card['threads']} CPU threads"
        + (f" (resumed at steps {card['resumed_at_steps']})" if card.get("resumed_at_steps") else ""),
        *[f"- stage {i + 1} of {len(card.get('earlier_stages', [])) + 1} (the run this one started from, "
          f"`init_from`): {st['steps']} steps, {st['tokens_seen']:,} tokens, {st['train_seconds'] / 60:.1f} min, "
          f"peak lr {st['recipe']['lr']}, {len(st['skipped_nonfinite_steps'])} skipped updates"
          + (f", command `{st['command']}`" if st.get("command") else "") + "; recipe in `model_card.json`"
          for i, st in enumerate(card.get("earlier_stages", []))],
        f"- validation on the first {v['stories']} stories of `{v['file']}`: "
        + (f"**{v['val_bits_per_byte']} bits per byte** (tokenizer-independent), " if "val_bits_per_byte" in v else "")
        + f"token perplexity {v['val_ppl']} (depends on the vocabulary: compare bits per byte across models)",
        f"- weights saved as {card['saved_dtype']} safetensors", "",
    ]
    if cost:
        lines += [
            "## Cost structure", "",
            f"One decoder layer holds {cost['params_per_layer']:,} parameters and the LM head "
            f"{cost['lm_head_params']:,}: the LM head is **{cost['lm_head_over_layer']} layers' worth** "
            "(Llama-2-7B: 32000 × 4096 = 131 M against 202 M per layer, 0.65). SpecEE's costs are "
            "priced in that unit: every exit verification is one full LM-head pass and every EAGLE "
            "draft step about one layer plus one LM head, so a miniature whose head is several "
            "layers' worth (the first tiny: 8192 × 192, 4.0) turns every early exit into a loss. "
            "The vocabulary is sized to keep this ratio near Llama-2-7B's.", "",
            "What the miniature preserves: depth (exit layers are read as fractions of the same "
            "32-layer stack as Llama-2-7B, so the paper's scheduling settings — offline M, window, "
            "N — apply unscaled), attention type (full multi-head, as Llama-2-7B/13B), MLP ratio "
            "(≈ 2.7 × hidden), RMSNorm, RoPE, untied embeddings, and the LM-head-to-layer cost ratio. "
            "What it does not: scale (width 192, not 4096: on a CPU per-op overheads, not FLOPs, set "
            "the speed), training data (TinyStories and children's books, no chat tuning), and any "
            "emergent behaviour of large models — its exit-layer distribution and context similarity "
            "are measured, not assumed to match Llama-2's.", "",
        ]
    if card.get("notes"):
        lines += ["## Training notes", "", *[f"- {n}" for n in card["notes"]], ""]
    curve_key = "val_bpb" if card["val_curve"] and "val_bpb" in card["val_curve"][0] else "val_ppl"
    lines += [
        "## Validation during training", "", f"| step (all stages) | {curve_key} |", "|---|---|",
        *[f"| {r['step'] + sum(st['steps'] for st in card.get('earlier_stages', [])[:i])} | {r[curve_key]} |"
          for i, curve in enumerate([st["val_curve"] for st in card.get("earlier_stages", [])] + [card["val_curve"]])
          for r in curve if curve_key in r], "",
        "## Greedy samples", "",
        *[f"- *{r['prompt']}* → {r['greedy_continuation']!r}" for r in card.get("samples", [])], "",
        "## Training data (sha256)", "",
        *[f"- `{k}` `{v}`" for k, v in card["data"].items()], "",
        "The full loss curve is in `model_card.json`.", "",
    ]
    return "\n".join(lines)
