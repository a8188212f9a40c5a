"""Recipe: train an EAGLE-1 style draft head for the configured base model.

    python run.py experiment=train_draft model=tiny            # the committed tiny draft head

1. extract the base model's final-normed hidden states over instruction data (gpteacher, dolly,
   alpaca) and TinyStories, packed into fixed-length blocks;
2. train the head to regress the next feature (smooth L1) and match the base model's next-token
   distribution through the shared lm_head (cross-entropy), as EAGLE does;
3. report top-1 / top-K agreement with the base model's next token on held-out blocks; save.
"""
from __future__ import annotations

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
from specee.runtime import LayerwiseLM


def training_blocks(cfg, tokenizer) -> tuple[torch.Tensor, dict]:
    e = cfg.experiment
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


def draft_loss(head: DraftHead, ids, feats, noise: float, p_weight: float):
    inp = feats[:, :-1]
    if noise:
        inp = inp + (torch.rand_like(inp) - 0.5) * noise  # EAGLE's feature noise
    f_hat = head(ids[:, 1:], inp)
    target = feats[:, 1:]
    v_loss = F.smooth_l1_loss(f_hat, target)
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
    blocks, files = training_blocks(cfg, tokenizer)
    feats = extract_features(model, blocks, e.extract_batch)
    n_eval = max(1, int(len(blocks) * e.eval_share))
    perm = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(cfg.seed))
    ev, tr = perm[:n_eval], perm[n_eval:]

    head = DraftHead(model.config).attach(rt).float()
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=e.lr, betas=(0.9, 0.95), weight_decay=0.0)
    curve, t0 = [], time.perf_counter()
    bar = tqdm(range(e.steps), desc="train draft")
    for step in bar:
        lr = e.lr * min(1.0, (step + 1) / e.warmup_steps) * \
            (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / e.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = tr[torch.randint(len(tr), (e.batch_size,))]
        loss, v, p = draft_loss(head, blocks[idx].to(rt.device), feats[idx].to(rt.device),
                                e.feature_noise, e.p_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == e.steps - 1:
            curve.append({"step": step + 1, "loss": round(loss.item(), 4), "v_loss": round(v.item(), 4),
                          "p_loss": round(p.item(), 4)})
            bar.set_postfix(loss=f"{loss.item():.3f}")
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
        "steps": e.steps, "train_seconds": round(time.perf_counter() - t0, 1),
        "held_out_agreement": quality, "loss_curve": curve,
    }
    out = project_path(e.out_dir)
    with atomic_dir(out) as tmp:
        head.to(torch.float32).save(tmp, card)
    print(f"saved draft head to {out}")
    return card
