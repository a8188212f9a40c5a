"""lm-eval model over a specee decoder (dense, SpecEE or AdaInfer), batch size 1.

Requests run one at a time through ``decoder.score`` (log-likelihoods: early-exit modes decide
the exit at every continuation position exactly as in decoding and take log-probs from the exit
layer) or ``decoder.generate`` (greedy generation). Batch size is 1 because the runtime is, as
in the SpecEE paper's latency setting.

Tokenisation follows lm-eval's Hugging Face model: trailing whitespace of the context moves to
the continuation, ``whole = encode(context + continuation)``, ``context = encode(context)``,
``continuation = whole[len(context):]``; an empty context becomes the BOS (else EOS) token.

Overflow policy (``on_overflow``): with ``"truncate"`` (default) a request longer than
``max_length`` (the model's max_position_embeddings, or its sliding window if smaller) loses
context tokens from the *left*, and the request is counted in ``truncated`` per task; with
``"error"`` it raises :class:`SpeceeError`. A continuation that alone does not fit always raises.
Generation keeps the last ``max_length - max_gen_toks`` context tokens under the same policy.

Consecutive requests that begin with the same tokens (the paper protocol's five shots, a
multiple-choice item's context) prefill them once (``prefix_reuse``, :mod:`specee.evaluation.prefix`):
the outputs and scores are those of a whole prefill, only faster.

Per request, ``records[(task, doc_id, idx)]`` keeps the mean decoder layers used (over the
scored or generated tokens) and whether it was truncated; ``task_stats()`` aggregates per task.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from tqdm import tqdm

from specee.errors import SpeceeError


class SpeceeLM(LM):
    def __init__(self, decoder, tokenizer, max_gen_toks: int = 128, max_length: int | None = None,
                 on_overflow: str = "truncate", prefix_reuse: bool = True):
        super().__init__()
        from specee.evaluation.prefix import PrefixReuse
        self.prefix = PrefixReuse(decoder.rt, getattr(decoder, "draft", None)) if prefix_reuse else None
        if on_overflow not in ("truncate", "error"):
            raise SpeceeError(f"on_overflow={on_overflow!r} is unknown; valid: truncate, error")
        self.decoder, self.tokenizer, self.rt = decoder, tokenizer, decoder.rt
        c = self.rt.config
        limits = [n for n in (max_length, getattr(c, "max_position_embeddings", None),
                              self.rt.sliding_window) if n]
        self.max_length = min(limits) if limits else 2048
        self.max_gen_toks, self.on_overflow = max_gen_toks, on_overflow
        self.records: dict[tuple, dict] = {}

    # -- tokens -----------------------------------------------------------------------------
    @property
    def prefix_token_id(self) -> int:
        t = self.tokenizer
        return t.bos_token_id if t.bos_token_id is not None else t.eos_token_id

    def tok_encode(self, text: str) -> list[int]:
        # Over-long requests are cut by _fit and counted (``truncated``): the tokenizer's own
        # "indexing errors" warning would read as a bug, so it is silenced here.
        return self.tokenizer.encode(text, verbose=False)

    # -- chat template (lm-eval's apply_chat_template=True: instruct models answer as assistant) --
    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:
            cont = self.tokenizer.encode(continuation, add_special_tokens=False, verbose=False)
            if cont and cont[0] == self.prefix_token_id:
                return cont[:1], cont[1:]
            return [self.prefix_token_id], cont
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return ctx, whole[len(ctx):]

    def _fit(self, ctx: list[int], room: int, what: str) -> tuple[list[int], bool]:
        """Keep the last ``room`` context tokens, per the overflow policy."""
        if room < 1:
            raise SpeceeError(f"{what} leaves no room for context within max_length={self.max_length}")
        if len(ctx) <= room:
            return ctx, False
        if self.on_overflow == "error":
            raise SpeceeError(f"{what}: context of {len(ctx)} tokens exceeds the {room} that fit in "
                              f"max_length={self.max_length} (experiment.on_overflow=truncate cuts it)")
        return ctx[-room:], True

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor([tokens], dtype=torch.long, device=self.rt.device)

    def _record(self, req, layers: list[int], truncated: bool) -> None:
        key = (req.task_name, req.doc_id, req.idx)
        self.records[key] = {"mean_layers": sum(layers) / max(len(layers), 1), "tokens": len(layers),
                             "truncated": truncated}

    def _reusing(self):
        """Inside: prefills start from the previous request's shared prefix (when enabled)."""
        return self.prefix.active() if self.prefix is not None else nullcontext()

    # -- lm-eval API -----------------------------------------------------------------------
    def score_tokens(self, ctx: list[int], cont: list[int]):
        """(Score, truncated) of ``cont`` after ``ctx``; the model sees len(ctx)+len(cont)-1 tokens."""
        if not cont:
            raise SpeceeError("an lm-eval request has an empty continuation; nothing to score")
        ctx, cut = self._fit(ctx, self.max_length + 1 - len(cont), f"a {len(cont)}-token continuation")
        return self.decoder.score(self._ids(ctx), cont), cut

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        with self._reusing():
            for req in tqdm(requests, desc=f"loglikelihood {self.decoder.name}", disable=disable_tqdm):
                score, cut = self.score_tokens(*self.encode_pair(*req.args))
                self._record(req, score.layers, cut)
                out.append((score.total, score.greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood in disjoint windows of max_length (lm-eval's scheme)."""
        out = []
        for req in tqdm(requests, desc=f"rolling {self.decoder.name}", disable=disable_tqdm):
            windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(req.args[0]), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            total, layers = 0.0, []
            for ctx, cont in windows:
                score, _ = self.score_tokens(ctx, cont)  # windows fit by construction
                total += score.total
                layers += score.layers
            self._record(req, layers, False)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        with self._reusing():
            return self._generate_until(requests, disable_tqdm)

    def _generate_until(self, requests, disable_tqdm: bool) -> list[str]:
        eos = self.tokenizer.eos_token_id
        out = []
        for req in tqdm(requests, desc=f"generate {self.decoder.name}", disable=disable_tqdm):
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            if kwargs.get("do_sample") or (kwargs.get("temperature") or 0) > 0:
                raise SpeceeError("specee decodes greedily; the task asks for sampling "
                                  "(generation_kwargs do_sample/temperature)")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            n_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ctx = self.tok_encode(context) if context else [self.prefix_token_id]
            ctx, cut = self._fit(ctx, self.max_length - n_new, f"generating {n_new} tokens")
            stops = [u for u in until if u]
            # Stop strings end the generation as soon as they appear (not after max_gen_toks). A
            # stop first appears ending in the newest token and spans at most its byte length in
            # tokens, so only that tail is decoded per step (not the whole text, quadratically).
            tail = max((len(u.encode()) for u in stops), default=0) + 1
            hit = (lambda toks: any(u in self.tokenizer.decode(toks[-tail:], skip_special_tokens=True)
                                    for u in stops)) if stops else None
            gen = self.decoder.generate(self._ids(ctx), n_new, eos, stop=hit)
            self.last_generation = (ctx, gen)  # what a recorder of this request reads (specee/frontier/tasks.py)
            tokens = gen.tokens[:gen.tokens.index(eos)] if eos in gen.tokens else gen.tokens
            text = self.written_text(ctx, tokens)
            for stop in until:  # cut at the earliest stop string
                if stop:
                    text = text.split(stop)[0]
            self._record(req, gen.layers_run, cut)
            out.append(text)
        return out

    def written_text(self, ctx: list[int], tokens: list[int]) -> str:
        """What the model wrote after its context: the decoded context + generation minus the
        decoded context. Decoding the new tokens alone can lose a leading space (SentencePiece
        drops it on a first token), and a character-offset parser such as the SpecEE authors'
        reads the text as it follows the prompt. Where the joint decoding does not begin with the
        context's own (a tokenizer that rewrites across the boundary), the tokens alone."""
        alone = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if not tokens:
            return alone
        head = self.tokenizer.decode(ctx, skip_special_tokens=True)
        joint = self.tokenizer.decode(ctx + tokens, skip_special_tokens=True)
        return joint[len(head):] if joint.startswith(head) else alone

    # -- what the experiment reports --------------------------------------------------------
    def task_stats(self) -> dict[str, dict]:
        per = defaultdict(list)
        for (task, _, _), r in self.records.items():
            per[task].append(r)
        return {task: {"mean_layers": sum(r["mean_layers"] for r in rs) / len(rs),
                       "layers_per_token": sum(r["mean_layers"] * r["tokens"] for r in rs)
                       / max(sum(r["tokens"] for r in rs), 1),
                       "requests": len(rs), "truncated": sum(r["truncated"] for r in rs)}
                for task, rs in per.items()}
