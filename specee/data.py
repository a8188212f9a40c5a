"""Read the shared corpora and prompt sets from the configurable data root.

Nothing here copies data into the repository: every reader takes the data root
(``paths.data_root`` in the config) and fails with one message naming that key
when a file is missing.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from specee.errors import SpeceeError

TINYSTORIES_TRAIN = "tinystories/tinystories_train_prefix_unsegmented.txt"
TINYSTORIES_VALID = "tinystories/tinystories_valid_prefix_first500.txt"
BOOKS_DIR = "children_books_pg"
SPEC_BENCH = "spec_bench/question.jsonl"
MT_BENCH = "mt_bench/question.jsonl"
EOT = "<|endoftext|>"


def data_root(path: str | Path) -> Path:
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise SpeceeError(
            f"data root {root} does not exist; set paths.data_root=/path/to/shared/data "
            "(the folder holding tinystories/, spec_bench/, ...)"
        )
    return root


def data_file(root: str | Path, rel: str) -> Path:
    path = data_root(root) / rel
    if not path.is_file():
        raise SpeceeError(f"missing data file {path}; check paths.data_root (expected {rel} under it)")
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_MOJIBAKE = re.compile("[\u00e2\u00c3][\u0080-\u00bf\u20ac\u201a-\u203a\u0152-\u0178\u2122]+")


def fix_mojibake(line: str) -> str:
    """Repair UTF-8 read as cp1252 ("â€™" -> "’"), present in some TinyStories lines."""
    if not _MOJIBAKE.search(line):
        return line
    try:
        return line.encode("cp1252").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return line


def unwrap_paragraphs(text: str) -> str:
    """Join hard-wrapped lines (Gutenberg books wrap at ~70 columns) into paragraphs."""
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paras if p)


@dataclass
class Corpus:
    name: str
    documents: list[str]
    files: dict[str, str]  # relative path -> sha256


def tinystories_train(root) -> Corpus:
    path = data_file(root, TINYSTORIES_TRAIN)
    text = "\n".join(fix_mojibake(l) for l in path.read_text(encoding="utf-8").splitlines())
    # Story boundaries are not marked in this slice; paragraphs are the safest unit.
    docs = [d.strip() for d in re.split(r"\n(?=[A-Z])", text) if d.strip()]
    return Corpus("tinystories", docs, {TINYSTORIES_TRAIN: sha256(path)})


def tinystories_valid(root) -> Corpus:
    path = data_file(root, TINYSTORIES_VALID)
    raw = path.read_text(encoding="utf-8")
    docs = [fix_mojibake(s).strip() for s in raw.split(EOT)]
    return Corpus("tinystories_valid", [d for d in docs if d], {TINYSTORIES_VALID: sha256(path)})


def children_books(root) -> Corpus:
    folder = data_root(root) / BOOKS_DIR
    files = sorted(folder.glob("pg*.txt"))
    if not files:
        raise SpeceeError(f"no pg*.txt books under {folder}; check paths.data_root")
    docs, shas = [], {}
    for f in files:
        docs.append(unwrap_paragraphs(f.read_text(encoding="utf-8")))
        shas[f"{BOOKS_DIR}/{f.name}"] = sha256(f)
    return Corpus("children_books_pg", docs, shas)


@dataclass
class Prompt:
    id: str
    category: str
    turns: list[str]


def spec_bench_prompts(root, categories: list[str] | None = None, count: int | None = None,
                       offset: int = 0, per_category: bool = True) -> list[Prompt]:
    """Spec-Bench questions; with ``per_category`` the first ``count`` of each category."""
    path = data_file(root, SPEC_BENCH)
    rows = [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]
    if categories:
        known = sorted({r["category"] for r in rows})
        bad = [c for c in categories if c not in known]
        if bad:
            raise SpeceeError(f"unknown Spec-Bench categories {bad}; valid: {known}")
        rows = [r for r in rows if r["category"] in categories]
    prompts = [Prompt(str(r["question_id"]), r["category"], list(r["turns"])) for r in rows]
    if count is None:
        return prompts[offset:]
    if per_category:
        out: dict[str, list[Prompt]] = {}
        for p in prompts:
            out.setdefault(p.category, []).append(p)
        prompts = [p for group in out.values() for p in group[offset:offset + count]]
    else:
        prompts = prompts[offset:offset + count]
    if not prompts:
        raise SpeceeError("the prompt selection is empty; check dataset.categories / count / offset")
    return prompts


INSTRUCTION_FILES = {
    "gpteacher_roleplay": "gpteacher/roleplay-simple-deduped-roleplay-instruct.json",
    "gpteacher_codegen": "gpteacher/codegen-instruct.json",
    "dolly_sample": "dolly_sample/dolly_151.jsonl",
    "alpaca_gpt4_demo": "alpaca_gpt4_demo/alpaca_en_demo.json",
}
TINYSTORIES_CONTINUATION = "tinystories/tinystories_valid_prefix_continuation_unsegmented.txt"


def instruction_pairs(root, sources: list[str] | None = None) -> tuple[list[tuple[str, str]], dict]:
    """(prompt, response) pairs from the instruction sets, and {file: sha256}."""
    pairs, shas = [], {}
    for name in sources or list(INSTRUCTION_FILES):
        if name not in INSTRUCTION_FILES:
            raise SpeceeError(f"unknown instruction source {name!r}; valid: {sorted(INSTRUCTION_FILES)}")
        path = data_file(root, INSTRUCTION_FILES[name])
        shas[INSTRUCTION_FILES[name]] = sha256(path)
        text = path.read_text(encoding="utf-8")
        rows = [json.loads(l) for l in text.splitlines() if l.strip()] if path.suffix == ".jsonl" \
            else json.loads(text)
        for r in rows:
            if "prompt" in r:  # dolly: already an Alpaca-style prompt
                pairs.append((r["prompt"].strip(), r["answer"].strip()))
            else:
                prompt = r["instruction"].strip() + (f"\n\n{r['input'].strip()}" if r.get("input") else "")
                pairs.append((prompt, (r.get("response") or r.get("output") or "").strip()))
    return [p for p in pairs if p[0] and p[1]], shas


def story_openings(root, count: int, words: int = 12) -> tuple[list[Prompt], dict]:
    """Openings of held-out TinyStories (the continuation slice, never used for training)."""
    path = data_file(root, TINYSTORIES_CONTINUATION)
    paras = [fix_mojibake(p).strip() for p in re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))]
    starts = [p for p in paras if len(p.split()) > 2 * words][:count]
    prompts = [Prompt(f"story{i}", "tinystories", [" ".join(p.split()[:words])]) for i, p in enumerate(starts)]
    return prompts, {TINYSTORIES_CONTINUATION: sha256(path)}


def calibration_prompts(root, c) -> tuple[list[Prompt], dict]:
    """Prompts for predictor training and exit profiling, disjoint from evaluation: Spec-Bench
    from ``c.spec_bench_offset`` on (evaluation reads lower offsets) + held-out story openings."""
    spec = spec_bench_prompts(root, None, c.spec_bench_count, c.spec_bench_offset)
    stories, files = story_openings(root, c.story_prompts)
    files[SPEC_BENCH] = sha256(data_file(root, SPEC_BENCH))
    return spec + stories, files


SOURCES = ("spec_bench", "mt_bench", "gsm8k", "humaneval", "alpaca")


def _jsonl(root, rel) -> list[dict]:
    path = data_file(root, rel)
    rows = [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]
    if not rows:
        raise SpeceeError(f"{path} is empty; check paths.data_root")
    return rows


def load_prompt_set(root, d) -> list[Prompt]:
    """The prompts of a ``dataset`` config node (source, categories, count, offset)."""
    if d.source == "spec_bench":
        return spec_bench_prompts(root, d.categories, d.count, d.offset)
    if d.source == "mt_bench":
        prompts = [Prompt(f"mt{r['question_id']}", r["category"], list(r["turns"])) for r in _jsonl(root, MT_BENCH)]
        if d.categories:
            prompts = [p for p in prompts if p.category in d.categories]
    elif d.source == "gsm8k":
        prompts = [Prompt(f"gsm8k{i}", "gsm8k", [r["question"]]) for i, r in enumerate(_jsonl(root, "gsm8k/test.jsonl"))]
    elif d.source == "humaneval":
        prompts = [Prompt(r["task_id"], "humaneval", [r["prompt"]]) for r in _jsonl(root, "humaneval/HumanEval.jsonl")]
    elif d.source == "alpaca":
        pairs, _ = instruction_pairs(root, ["alpaca_gpt4_demo"])
        prompts = [Prompt(f"alpaca{i}", "alpaca", [p]) for i, (p, _) in enumerate(pairs)]
    else:
        raise SpeceeError(f"dataset.source={d.source!r} is unknown; valid: {', '.join(SOURCES)}")
    prompts = prompts[d.offset:d.offset + d.count] if d.count else prompts[d.offset:]
    if not prompts:
        raise SpeceeError("the prompt selection is empty; check dataset.categories / count / offset")
    return prompts
