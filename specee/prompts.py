"""Format prompts the way each model was trained to see them (a wrong template skews speedups)."""
from __future__ import annotations

from specee.errors import SpeceeError

LLAMA2_SYSTEM = ("You are a helpful, respectful and honest assistant.")
CHATML_SYSTEM = "You are a helpful assistant."
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")


def format_conversation(template: str, turns: list[tuple[str, str | None]], tokenizer=None) -> str:
    """Render (user, assistant) pairs; the last assistant reply is None (to be generated).

    ``auto`` and ``tokenizer`` use the checkpoint's own chat template (``apply_chat_template``);
    ``auto`` falls back to ``plain`` when the tokenizer carries none. The named templates are
    hand-written for checkpoints that ship without one."""
    if template in ("auto", "tokenizer"):
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            return _tokenizer_template(tokenizer, turns)
        if template == "tokenizer":
            raise SpeceeError("model.chat_template=tokenizer but this checkpoint's tokenizer carries no chat "
                              f"template; use one of {', '.join(TEMPLATES[2:])}")
        template = "plain"
    if template == "plain":
        parts = []
        for user, reply in turns:
            parts.append(user)
            if reply is not None:
                parts.append(reply)
        return "\n\n".join(parts) + ("\n\n" if len(turns) > 1 or turns[-1][1] is not None else "\n")
    if template == "llama2_chat":
        out = ""
        for i, (user, reply) in enumerate(turns):
            if i == 0:
                user = f"<<SYS>>\n{LLAMA2_SYSTEM}\n<</SYS>>\n\n{user}"
            out += f"[INST] {user.strip()} [/INST]"
            if reply is not None:
                out += f" {reply.strip()} </s><s>"
        return out
    if template == "vicuna":
        out = VICUNA_SYSTEM + " "
        for user, reply in turns:
            out += f"USER: {user.strip()} ASSISTANT:"
            if reply is not None:
                out += f" {reply.strip()}</s>"
        return out
    if template == "mistral_inst":  # Mistral-7B-Instruct: [INST] without a system block
        out = ""
        for user, reply in turns:
            out += f"[INST] {user.strip()} [/INST]"
            if reply is not None:
                out += f" {reply.strip()}</s>"
        return out
    if template == "chatml":  # Qwen2-Instruct
        out = f"<|im_start|>system\n{CHATML_SYSTEM}<|im_end|>\n"
        for user, reply in turns:
            out += f"<|im_start|>user\n{user.strip()}<|im_end|>\n<|im_start|>assistant\n"
            if reply is not None:
                out += f"{reply.strip()}<|im_end|>\n"
        return out
    raise SpeceeError(f"chat template {template!r} is unknown; valid: {', '.join(TEMPLATES)}")


def _tokenizer_template(tokenizer, turns) -> str:
    messages = []
    for user, reply in turns:
        messages.append({"role": "user", "content": user})
        if reply is not None:
            messages.append({"role": "assistant", "content": reply})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=turns[-1][1] is None)
    # The prompt is tokenized later with the tokenizer's special tokens: a template that writes the
    # BOS itself would otherwise get a second one.
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and tokenizer("").input_ids[:1] == [tokenizer.bos_token_id]:
        text = text[len(bos):]
    return text


TEMPLATES = ("auto", "tokenizer", "plain", "llama2_chat", "vicuna", "mistral_inst", "chatml")


class PromptEncoder:
    """Prompt text -> token ids that fit the model's positions with room for the generation.

    A longer prompt keeps its last tokens (Spec-Bench's long summarisation/RAG inputs on a
    short-context model). Every cut is recorded (``truncated``) and said once in plain words
    (``note``); the tokenizer's own over-length warning, which reads as an indexing bug, is
    silenced because the cut is made here before the model ever sees the sequence."""

    def __init__(self, tokenizer, limit: int | None, max_new_tokens: int, device=None):
        self.tokenizer, self.limit, self.max_new_tokens, self.device = tokenizer, limit, max_new_tokens, device
        self.truncated: dict[str, dict] = {}  # prompt id -> {"tokens": before, "kept": after}

    @classmethod
    def for_runtime(cls, tokenizer, rt, max_new_tokens: int) -> "PromptEncoder":
        return cls(tokenizer, getattr(rt.config, "max_position_embeddings", None), max_new_tokens, rt.device)

    def __call__(self, text: str, prompt_id: str | None = None):
        ids = self.tokenizer(text, return_tensors="pt", verbose=False).input_ids
        if self.limit and ids.shape[1] + self.max_new_tokens > self.limit:
            keep = max(1, self.limit - self.max_new_tokens)
            key = prompt_id if prompt_id is not None else f"#{len(self.truncated)}"
            self.truncated.setdefault(key, {"tokens": int(ids.shape[1]), "kept": keep})
            ids = ids[:, -keep:]
        return ids.to(self.device) if self.device is not None else ids

    def note(self) -> str | None:
        """One sentence on what was cut, or None."""
        if not self.truncated:
            return None
        cuts = ", ".join(f"{k} ({v['tokens']} tokens)" for k, v in self.truncated.items())
        keep = next(iter(self.truncated.values()))["kept"]
        return (f"{len(self.truncated)} prompt(s) longer than the model's {self.limit} positions minus "
                f"{self.max_new_tokens} new tokens kept their last {keep} tokens: {cuts}")

    def record(self) -> list[dict]:
        return [{"id": k, **v} for k, v in self.truncated.items()]
