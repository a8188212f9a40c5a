"""EAGLE-1 style draft head over a base model's features.

    f_hat[i+1] = Layer( fc( cat(embed(x[i+1]), f[i]) ) )      logits = lm_head(f_hat)

``f`` is the base model's *final-normed* hidden state (what its lm_head reads), the decoder
layer is the base model's own layer class without its input norm, and the embeddings, rotary
embedding and lm_head are the base model's modules, shared, not copied. The head keeps its
own one-layer :class:`~specee.runtime.layerwise.LayerKVCache`.

Checkpoints: specee's own format (``draft.safetensors`` + ``draft_card.json``) or an EAGLE-1
folder (``config.json`` + ``pytorch_model.bin`` / ``*.safetensors`` with ``fc.*`` and
``layers.0.*`` keys, e.g. a local copy of EAGLE-llama2-chat-7B).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from specee.cards import read_card, safetensors_shapes
from specee.errors import SpeceeError
from specee.runtime.layerwise import LayerKVCache, LayerwiseLM

CARD = "draft_card.json"
WEIGHTS = "draft.safetensors"


class DraftHead(nn.Module):
    def __init__(self, base_config):
        super().__init__()
        cfg = copy.deepcopy(base_config)
        cfg.num_hidden_layers = 1
        if hasattr(cfg, "layer_types") and cfg.layer_types:
            cfg.layer_types = cfg.layer_types[:1]
        self.config = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=True)
        self._layer_cls = None
        self.layer = None  # built by attach(): needs the base model's decoder-layer class
        self.reduced = None  # a ReducedHead (draft.vocab_size=N): proposals from N tokens only

    def attach(self, rt: LayerwiseLM) -> "DraftHead":
        """Build the decoder layer with the base model's layer class and bind shared modules."""
        if self.layer is None:
            layer = type(rt.layers[0])(self.config, 0)
            layer.input_layernorm = nn.Identity()  # EAGLE-1: no input norm on the draft layer
            self.layer = layer
        self._rt = rt  # not a submodule: embeddings/lm_head stay the base model's
        return self.to(device=rt.device, dtype=rt.dtype)

    @property
    def rt(self) -> LayerwiseLM:
        return self._rt

    def new_cache(self, capacity: int = 256) -> LayerKVCache:
        return self.rt.new_cache(capacity, num_layers=1)

    def forward(self, next_ids: torch.Tensor, feats: torch.Tensor, cache: LayerKVCache | None = None,
                position_ids: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """next_ids: (1, T) tokens x[i+1]; feats: (1, T, d) features f[i]. Returns f_hat (1, T, d).

        ``mask``: an additive attention mask over cache + block (a draft tree level); default causal."""
        rt = self.rt
        x = self.fc(torch.cat([rt.embed(next_ids), feats], dim=-1))
        if position_ids is None:
            start = cache.seq_len if cache is not None else 0
            position_ids = torch.arange(start, start + x.shape[1], device=x.device).unsqueeze(0)
        rope = rt.rotary(x, position_ids=position_ids)
        if mask is None and cache is not None:  # the runtime's own layer step (compiled where it is)
            out = rt.step_layer(self.layer, 0, x, rope, cache, None, position_ids)
        else:
            if mask is None:
                mask = rt.mask_for(0, x.shape[1], None)
            out = self.layer(x, attention_mask=mask, position_embeddings=rope, position_ids=position_ids,
                             cache=cache, use_cache=cache is not None)
        if cache is not None:
            cache.seq_len += x.shape[1]
        return out

    def logits(self, f_hat: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (training and agreement checks)."""
        return self.rt.lm_head(f_hat)

    def topk(self, f_hat: torch.Tensor, k: int) -> torch.Tensor:
        """The k proposed token ids per position: over the reduced vocabulary when one is set
        (:mod:`specee.models.draft_vocab`), else over the full LM head."""
        if self.reduced is not None:
            return self.reduced.topk(f_hat, k)
        return self.rt.lm_head(f_hat).topk(k, -1).indices

    def restrict_vocab(self, ids: list[int]) -> "DraftHead":
        from specee.models.draft_vocab import ReducedHead
        self.reduced = ReducedHead(self.rt.lm_head, ids)
        return self

    # -- persistence ------------------------------------------------------------------------
    def save(self, folder: Path, card: dict) -> None:
        from safetensors.torch import save_file
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()},
                  str(folder / WEIGHTS))
        (folder / CARD).write_text(json.dumps(card, indent=1))


_FIX = "retrain the draft head (experiment=train_draft) or point draft.path at another one"
_CARD_KEYS = {"base_num_layers": int, "hidden_size": int}


def check_draft(path: str | Path, num_layers: int, hidden_size: int) -> dict:
    """The draft folder's card and weight shapes against the base model, without reading the
    weights (preflight, before the base model loads); returns the card."""
    folder = Path(path)
    if not folder.is_dir():
        raise SpeceeError(f"draft.path={path} is not a directory; train one with "
                          "`python run.py experiment=train_draft` or point it at an EAGLE-1 checkpoint")
    if not (folder / CARD).exists() and not (folder / WEIGHTS).exists():
        files = sorted(folder.glob("*.safetensors"))
        if not files and not (folder / "pytorch_model.bin").is_file():
            raise SpeceeError(f"{folder} holds neither {CARD} (specee draft) nor EAGLE weights "
                              "(pytorch_model.bin / *.safetensors)")
        for f in files:
            safetensors_shapes(f, _FIX)
        return {"format": "eagle-1", "path": str(folder)}
    card = read_card(folder / CARD, _FIX, _CARD_KEYS, "draft card")
    from specee.artifact_checks import check_card_values
    check_card_values(card, folder / CARD, "draft card", {"base_num_layers": "positive", "hidden_size": "positive",
                                                          "format": "text", "base_weights_fingerprint": "text"}, _FIX)
    if card["base_num_layers"] != num_layers or card["hidden_size"] != hidden_size:
        raise SpeceeError(f"the draft head at {folder} was trained for another base model "
                          f"({card.get('base_model')}: {card['base_num_layers']} layers, hidden size "
                          f"{card['hidden_size']}; this model {num_layers}, {hidden_size}); train one for this model")
    shapes = safetensors_shapes(folder / WEIGHTS, _FIX)
    want = {"fc.weight": (hidden_size, 2 * hidden_size), "fc.bias": (hidden_size,)}
    wrong = {k: shapes.get(k) for k, v in want.items() if shapes.get(k) != v}
    if wrong or not any(k.startswith("layer.") for k in shapes):
        raise SpeceeError(f"{folder / WEIGHTS} does not fit this base model (hidden size {hidden_size}): "
                          f"{wrong or 'no layer.* weights'}; {_FIX}")
    return card


def load_draft(path: str | Path, rt: LayerwiseLM, vocab_size: int = 0) -> tuple[DraftHead, dict]:
    """Load a specee draft folder or an EAGLE-1 checkpoint folder for the base model ``rt``;
    ``vocab_size`` N > 0 restricts its proposals to the N most frequent tokens of the folder's
    frequency table (:mod:`specee.models.draft_vocab`)."""
    folder = Path(path)
    card = check_draft(folder, rt.num_layers, rt.config.hidden_size)
    head = DraftHead(rt.config).attach(rt)
    state = _read_weights(folder / WEIGHTS) if card.get("format") != "eagle-1" else _eagle_state(folder)
    from specee.artifact_checks import check_finite
    check_finite(state, folder / WEIGHTS if card.get("format") != "eagle-1" else folder, _FIX)
    own = head.state_dict()
    missing = [k for k in own if k not in state]
    wrong = [k for k in own if k in state and state[k].shape != own[k].shape]
    if missing or wrong:
        raise SpeceeError(f"draft checkpoint {folder} does not fit this base model: "
                          f"missing {missing[:4]}, wrong shape {wrong[:4]}")
    head.load_state_dict({k: state[k].to(rt.dtype) for k in own})
    if vocab_size:
        from specee.models.draft_vocab import VOCAB_FILE, coverage_of, read_table, reduced_ids
        table = read_table(folder, rt.lm_head.weight.shape[0])
        head.restrict_vocab(reduced_ids(table, vocab_size))
        card = {**card, "reduced_vocab": {"size": vocab_size, "held_out_coverage": coverage_of(table, vocab_size),
                                          "table": str(folder / VOCAB_FILE)}}
    return head.eval(), card


def _read_weights(file: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not file.is_file():
        raise SpeceeError(f"missing {file}; retrain the draft head (experiment=train_draft)")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as err:
        raise SpeceeError(f"{file} is corrupt ({err}); retrain the draft head") from err


def _eagle_state(folder: Path) -> dict:
    """Map EAGLE-1 keys (fc.*, layers.0.*) onto DraftHead's (fc.*, layer.*)."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        raw = {}
        for f in files:
            raw.update(_read_weights(f))
    elif (folder / "pytorch_model.bin").is_file():
        from specee.artifact_checks import safe_torch_load
        raw = safe_torch_load(folder / "pytorch_model.bin", _FIX)
    else:
        raise SpeceeError(f"{folder} holds neither {CARD} (specee draft) nor EAGLE weights "
                          "(pytorch_model.bin / *.safetensors)")
    state = {}
    for k, v in raw.items():
        if k.startswith("fc."):
            state[k] = v
        elif k.startswith("layers.0."):
            state["layer." + k[len("layers.0."):]] = v
    return state
