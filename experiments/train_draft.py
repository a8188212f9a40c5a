"""Recipe: train an EAGLE-1 style draft head for the configured base model.

    python run.py experiment=train_draft model=tiny            # the committed tiny draft head
    python run.py experiment=train_draft model=smollm2_135m experiment.targets=self ...  # a chat model

1. extract the base model's final-normed hidden states over instruction data (gpteacher, dolly,
   alpaca) and TinyStories, packed into fixed-length blocks -- or, with ``targets=self`` (EAGLE's
   self-distillation), over instruction prompts in the model's chat template followed by the
   model's own greedy continuations;
2. train the head to regress the next feature (smooth L1) and match the base model's next-token
   distribution through the shared lm_head (cross-entropy), as EAGLE does;
3. report top-1 / top-K agreement with the base model's next token on held-out blocks; save.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import time

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from tqdm import tqdm

from specee import data, results
from specee.io import atomic_dir, project_path
from specee.models.draft import DraftHead
from specee.models.loader import load_model, weights_fingerprint
from specee.prompts import format_conversation
from specee.runtime.layerwise import LayerwiseLM


def pack(streams: list[list[int]], seq_len: int) -> torch.Tensor:
    stream = [t for s in streams for t in s]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len)


@torch.inference_mode()
def self_distillation_set(cfg, model, tokenizer) -> tuple[list[list[int]], dict]:
    """Instruction prompts (chat template) + the model's own greedy continuation, as token lists.
    Cached in the checkpoint folder (keyed by the recipe) so a resumed run does not regenerate."""
    e = cfg.experiment
    root = project_path(cfg.paths.data_root)
    pairs, files = data.instruction_pairs(root)
    prompts = [p for p, _ in pairs]
    random.Random(cfg.seed).shuffle(prompts)
    prompts = prompts[: e.distill_prompts]
    key = {"prompts": prompts, "new_tokens": e.distill_new_tokens, "template": cfg.model.chat_template,
           "fingerprint": weights_fingerprint(model)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache = project_path(e.checkpoint_dir) / f"distill_{digest}.pt"
    if cache.is_file():
        print(f"reusing the self-distillation set {cache}")
        return torch.load(cache, weights_only=True), files  # token lists only: nothing to run
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    encoded = [tokenizer(format_conversation(cfg.model.chat_template, [(p, None)], tokenizer))["input_ids"]
               for p in prompts]
    encoded = [ids[-(e.seq_len // 2):] for ids in encoded]  # long prompts keep their end
    streams = []
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths batch together
    for i in tqdm(range(0, len(order), e.distill_batch), desc="self-distillation continuations"):
        batch = [encoded[j] for j in order[i:i + e.distill_batch]]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch], device=model.device)
        attn = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch], device=model.device)
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=e.distill_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=pad)
        for b, row in zip(batch, out[:, width:].tolist()):
            cont = row[: row.index(eos) + 1] if eos in row else row
            streams.append(b + cont)
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(streams, cache)
    return streams, files


def training_blocks(cfg, tokenizer, model=None) -> tuple[torch.Tensor, dict]:
    e = cfg.experiment
    if e.targets == "self":
        streams, files = self_distillation_set(cfg, model, tokenizer)
        return pack(streams, e.seq_len), files
    root = project_path(cfg.paths.data_root)
    rng = random.Random(cfg.seed)
    pairs, files = data.instruction_pairs(root)
    texts = [format_conversation(cfg.model.chat_template, [(p, r)]) for p, r in pairs]
    stories = data.tinystories_train(root)
    files.update(stories.files)
    texts += stories.documents
    rng.shuffle(texts)
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    budget = e.max_tokens
    for t in texts:
        stream += tokenizer(t, add_special_tokens=False)["input_ids"] + [eos]
        if len(stream) >= budget:
            break
    n = len(stream) // e.seq_len
    return torch.tensor(stream[: n * e.seq_len]).view(n, e.seq_len), files


@torch.inference_mode()
def extract_features(model, blocks: torch.Tensor, batch: int) -> torch.Tensor:
    """Final-normed hidden states (what lm_head reads) for every block position."""
    out = []
    for i in tqdm(range(0, len(blocks), batch), desc="extract base features"):
        ids = blocks[i:i + batch].to(model.device)
        out.append(model.model(input_ids=ids).last_hidden_state.float().cpu())
    return torch.cat(out)


def draft_loss(head: DraftHead, ids, feats, noise: float, p_weight: float, p_positions: int | None = None):
    inp = feats[:, :-1]
    if noise:
        inp = inp + (torch.rand_like(inp) - 0.5) * noise  # EAGLE's feature noise
    f_hat = head(ids[:, 1:], inp)
    target = feats[:, 1:]
    v_loss = F.smooth_l1_loss(f_hat, target)
    if p_positions is not None and p_positions < target.shape[0] * target.shape[1]:
        # The LM head over a large vocabulary dominates a step: its loss on a random sample of positions.
        pick = torch.randperm(target.shape[0] * target.shape[1], device=target.device)[:p_positions]
        f_hat, target = f_hat.reshape(-1, f_hat.shape[-1])[pick], target.reshape(-1, target.shape[-1])[pick]
    with torch.no_grad():
        p_target = F.softmax(head.logits(target), -1)
    p_loss = -(p_target * F.log_softmax(head.logits(f_hat), -1)).sum(-1).mean()
    return v_loss + p_weight * p_loss, v_loss, p_loss


@torch.inference_mode()
def agreement(head: DraftHead, blocks, feats, k: int, batch: int = 8) -> dict:
    """Top-1 / top-K agreement of the draft with the base model's greedy next token."""
    hit1 = hitk = total = 0
    for i in range(0, len(blocks), batch):
        ids, f = blocks[i:i + batch].to(head.rt.device), feats[i:i + batch].to(head.rt.device)
        draft_logits = head.logits(head(ids[:, 1:], f[:, :-1]))
        base_next = head.logits(f[:, 1:]).argmax(-1)
        topk = draft_logits.topk(k, -1).indices
        hit1 += (topk[..., 0] == base_next).sum().item()
        hitk += (topk == base_next[..., None]).any(-1).sum().item()
        total += base_next.numel()
    return {"top1": hit1 / total, f"top{k}": hitk / total, "positions": total}


def run(cfg) -> dict:
    e = cfg.experiment
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    for p in model.parameters():
        p.requires_grad_(False)
    rt = LayerwiseLM(model)
    blocks, files = training_blocks(cfg, tokenizer, model)
    feats = extract_features(model, blocks, e.extract_batch)
    n_eval = max(1, int(len(blocks) * e.eval_share))
    perm = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(cfg.seed))
    ev, tr = perm[:n_eval], perm[n_eval:]

    head = DraftHead(model.config).attach(rt).float()
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=e.lr, betas=(0.9, 0.95), weight_decay=0.0)
    curve, t0, start, trained_s = [], time.perf_counter(), 0, 0.0
    # Resume point: same recipe, seed and base model only (anything else starts afresh).
    recipe = json.dumps({"recipe": OmegaConf.to_container(e, resolve=True), "seed": cfg.seed,
                         "base": weights_fingerprint(model)}, sort_keys=True)
    state_path = project_path(e.checkpoint_dir) / \
        f"train_state_{hashlib.sha256(recipe.encode()).hexdigest()[:16]}.pt"
    if state_path.is_file():
        state = torch.load(state_path, weights_only=True)  # a resume point never runs code it carries
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["rng"])
        start, curve, trained_s = state["step"], state["curve"], state["train_seconds"]
        print(f"resuming draft training at step {start} from {state_path}")
    last_save = time.perf_counter()
    bar = tqdm(range(start, e.steps), desc="train draft", initial=start, total=e.steps)
    for step in bar:
        lr = e.lr * min(1.0, (step + 1) / e.warmup_steps) * \
            (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / e.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = tr[torch.randint(len(tr), (e.batch_size,))]
        loss, v, p = draft_loss(head, blocks[idx].to(rt.device), feats[idx].to(rt.device),
                                e.feature_noise, e.p_weight, e.p_positions)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == e.steps - 1:
            curve.append({"step": step + 1, "loss": round(loss.item(), 4), "v_loss": round(v.item(), 4),
                          "p_loss": round(p.item(), 4)})
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if e.checkpoint_minutes and time.perf_counter() - last_save > 60 * e.checkpoint_minutes:
            state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = state_path.with_suffix(".tmp")
            torch.save({"step": step + 1, "head": head.state_dict(), "opt": opt.state_dict(),
                        "rng": torch.get_rng_state(), "curve": curve,
                        "train_seconds": trained_s + time.perf_counter() - t0}, tmp)
            tmp.replace(state_path)
            last_save = time.perf_counter()
    head.eval()
    quality = agreement(head, blocks[ev], feats[ev], e.k)
    print(f"draft agreement on {quality['positions']} held-out positions: top1 {quality['top1']:.3f}, "
          f"top{e.k} {quality[f'top{e.k}']:.3f}")
    base_hash = weights_fingerprint(model)
    card = {
        "format": "specee-draft-1", "architecture": "EAGLE-1 (fc 2d->d + 1 decoder layer, shared lm_head)",
        "base_model": cfg.model.name, "base_num_layers": rt.num_layers,
        "hidden_size": model.config.hidden_size, "base_weights_fingerprint": base_hash,
        "command": results.command_line(),
        "recipe": OmegaConf.to_container(e, resolve=True), "seed": cfg.seed, "data": files,
        "blocks": {"train": len(tr), "held_out": len(ev), "seq_len": e.seq_len},
        "steps": e.steps, "train_seconds": round(trained_s + time.perf_counter() - t0, 1),
        "held_out_agreement": quality, "loss_curve": curve,
    }
    out = project_path(e.out_dir)
    with atomic_dir(out) as tmp:
        head.to(torch.float32).save(tmp, card)
    print(f"saved draft head to {out}")
    return card
