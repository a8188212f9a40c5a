"""Prompt and split functions referenced by the task YAMLs (``!function utils.<name>``).

Split policy: the shared data holds one labelled split per task (validation or test), so each
file is cut in two: its first ``FEWSHOT_POOL`` items are the few-shot pool, evaluation uses the
rest (``--limit n`` takes the first n of those). An evaluated item is never its own or another
evaluated item's shot. The pool is even, so WinoGrande's adjacent twin sentences stay together.
"""
from __future__ import annotations

import re

FEWSHOT_POOL = 20


def eval_docs(dataset):
    return dataset.select(range(FEWSHOT_POOL, len(dataset)))


def fewshot_docs(dataset):
    return dataset.select(range(min(FEWSHOT_POOL, len(dataset))))


# -- HellaSwag (lm-eval's preprocessing; the shared file joins ctx_a and ctx_b already) ------
def _clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")  # WikiHow artefacts
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _hellaswag(dataset):
    return dataset.map(lambda d: {"query": _clean(d["activity_label"] + ": " + d["ctx"]),
                                  "choices": [_clean(e) for e in d["endings"]], "gold": int(d["label"])})


def hellaswag_eval_docs(dataset):
    return _hellaswag(eval_docs(dataset))


def hellaswag_fewshot_docs(dataset):
    return _hellaswag(fewshot_docs(dataset))


# -- WinoGrande: partial scoring, the shared suffix scored under each filled-in prefix -------
def winogrande_gold(doc) -> int:
    return doc["gold"]  # an int from doc_to_text tells lm-eval the contexts are the choices


def winogrande_contexts(doc) -> list[str]:
    return doc["context_options"]


def winogrande_suffix(doc) -> str:
    return doc["continuation"].strip()


# -- GSM8K: the reference is the number after "####" ----------------------------------------
def gsm8k_final_number(doc) -> str:
    return doc["answer"].split("####")[-1].strip().replace(",", "")


# -- TinyStories validation: one document per story (the file ends each with <|endoftext|>) --
def tinystories_stories(dataset):
    from datasets import Dataset
    text = "\n".join(dataset["text"])
    stories = [s.strip() for s in text.split("<|endoftext|>")]
    return Dataset.from_list([{"text": s} for s in stories if s])
