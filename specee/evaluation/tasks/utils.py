"""Prompt and split functions referenced by the task YAMLs (``!function utils.<name>``).

Split policy: the shared data holds one labelled split per task (validation or test), so each
file is cut in two: its first ``FEWSHOT_POOL`` items are the few-shot pool, evaluation uses the
rest (``--limit n`` takes the first n of those). An evaluated item is never its own or another
evaluated item's shot. The pool is even, so WinoGrande's adjacent twin sentences stay together.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

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


# -- The SpecEE authors' accuracy protocol (csqa_paper, sst2_paper) -------------------------
# Their EEInference.py --task accuracy: a fixed five-shot prompt (paper_prompts/, byte for byte),
# tokenized raw, exactly 3 greedy new tokens with no stop string, and the answer read by character
# offset from the decoded text that follows the prompt. Every item is evaluated (their shots come
# from the training splits), so no few-shot pool is cut off here.
PAPER_PROMPTS = Path(__file__).resolve().parent / "paper_prompts"
UNPARSED = "N/A"  # what the authors' parser records when nothing is left to read


@functools.cache
def paper_shots(name: str) -> str:
    with open(PAPER_PROMPTS / name, encoding="utf-8", newline="") as f:  # keep their bytes
        return f.read()


def csqa_paper_prompt(doc) -> str:
    """The shots, the question, then one ``"X. text"`` line per choice; the model itself has to
    write ``Answer: X`` (the authors' ``get_commonsenseqa_prompt``)."""
    c = doc["choices"]
    return (paper_shots("commonsense_qa_5shot.txt") + doc["question"] + "\n"
            + "".join(f"{label}. {text}\n" for label, text in zip(c["label"], c["text"])))


def sst2_paper_prompt(doc) -> str:
    """The shots, ``Sentence: <sentence>``, then ``Sentiment`` with no colon (``get_sst2_prompt``)."""
    return paper_shots("sst2_5shot.txt") + "Sentence: " + doc["sentence"] + "\n" + "Sentiment"


def csqa_paper_target(doc) -> str:
    return doc["answerKey"].strip()


def sst2_paper_target(doc) -> str:
    return str(doc["label"]).strip()


def offset_answer(written: str, skip: int, upper: bool = False) -> str:
    """The authors' parse of what the model wrote after the prompt: drop ``skip`` characters (the
    ``Answer:`` it is expected to write, or SST-2's ``:``), strip, take the first character —
    whatever the skipped characters were; nothing left is ``N/A``."""
    rest = written[skip:].strip()
    if not rest:
        return UNPARSED
    return rest[0].upper() if upper else rest[0]


def csqa_paper_parse(resps, docs):
    return [[offset_answer(r, len("Answer:"), upper=True) for r in rs] for rs in resps]


def sst2_paper_parse(resps, docs):
    return [[offset_answer(r, len(":")) for r in rs] for rs in resps]
