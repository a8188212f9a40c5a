"""Read the corpora and prompt sets from the configurable data root.

Every reader takes the data root (``paths.data_root``; default: the evaluation data shipped in the
repository's ``data/``) and fails with one message naming that key when a file is missing. Files
needed only to retrain `tiny` and its draft head are not shipped; their message says where they
come from.
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
TINYSTORIES_CONTINUATION = "tinystories/tinystories_valid_prefix_continuation_unsegmented.txt"
# The tinystories files the repository ships (validation and calibration, not training).
SHIPPED = {TINYSTORIES_VALID, TINYSTORIES_CONTINUATION}
BOOKS_DIR = "children_books_pg"
SPEC_BENCH = "spec_bench/question.jsonl"
MT_BENCH = "mt_bench/question.jsonl"
EOT = "<|endoftext|>"


# Training corpora that stay outside the repository: (folder, what needs it, where it comes from).
TRAINING_ONLY = {
    "tinystories": ("training tiny and its draft head",
                    "the first ~1,000 stories of the TinyStories train split (HF roneneldan/TinyStories, "
                    "CDLA-Sharing-1.0) as one text file"),
    "children_books_pg": ("training tiny", "public-domain children's books from Project Gutenberg, "
                          "header/footer stripped (see the model card for the file list and sha256)"),
    "gpteacher": ("training the tiny draft head", "teknium1/GPTeacher (MIT)"),
    "dolly_sample": ("training the tiny draft head", "a 151-row sample of databricks-dolly-15k (CC BY-SA 3.0)"),
    "alpaca_gpt4_demo": ("training the tiny draft head and dataset=alpaca",
                         "LLaMA-Factory's alpaca_en_demo.json (Alpaca-GPT4, CC BY-NC 4.0: not redistributed)"),
}


def data_root(path: str | Path) -> Path:
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise SpeceeError(
            f"data root {root} does not exist; set paths.data_root=/path/to/data (or SPECEE_DATA_ROOT), "
            "a folder laid out like the repository's data/ (spec_bench/, boolq/, tinystories/, ...)"
        )
    return root


def data_file(root: str | Path, rel: str) -> Path:
    path = data_root(root) / rel
    if not path.is_file():
        need = TRAINING_ONLY.get(rel.split("/")[0])
        if need and (rel not in SHIPPED):
            raise SpeceeError(
                f"missing data file {path}: it is needed only for {need[0]} and is not shipped in the "
                f"repository; get {need[1]} and set paths.data_root to a folder holding {rel}")
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
    text = "\n".join(fix_mojibake(l) for l in path.read_text(encoding="utf-8-sig").splitlines())
    # Story boundaries are not marked in this slice; paragraphs are the safest unit.
    docs = [d.strip() for d in re.split(r"\n(?=[A-Z])", text) if d.strip()]
    return Corpus("tinystories", docs, {TINYSTORIES_TRAIN: sha256(path)})


def tinystories_valid(root) -> Corpus:
    path = data_file(root, TINYSTORIES_VALID)
    raw = path.read_text(encoding="utf-8-sig")
    docs = [fix_mojibake(s).strip() for s in raw.split(EOT)]
    return Corpus("tinystories_valid", [d for d in docs if d], {TINYSTORIES_VALID: sha256(path)})


def children_books(root) -> Corpus:
    folder = data_root(root) / BOOKS_DIR
    files = sorted(folder.glob("pg*.txt"))
    if not files:
        need = TRAINING_ONLY[BOOKS_DIR]
        raise SpeceeError(f"no pg*.txt books under {folder}: they are needed only for {need[0]} and are "
                          f"not shipped in the repository; get {need[1]} and set paths.data_root to a "
                          f"folder holding {BOOKS_DIR}/")
    docs, shas = [], {}
    for f in files:
        docs.append(unwrap_paragraphs(f.read_text(encoding="utf-8-sig")))
        shas[f"{BOOKS_DIR}/{f.name}"] = sha256(f)
    return Corpus("children_books_pg", docs, shas)


@dataclass
class Prompt:
    id: str
    category: str
    turns: list[str]


def iter_jsonl(path: Path):
    """(line number, row) of each non-blank line; a bad line (not UTF-8, not JSON) or an unreadable
    file is one error naming file:line. Lines are read as bytes and decoded one by one, so a file
    of random bytes is refused at its first bad line, not by a decoder's traceback."""
    try:
        f = open(path, "rb")
    except OSError as err:
        raise SpeceeError(f"{path}: cannot be read ({err.strerror or type(err).__name__}); "
                          "point at a JSONL file (one JSON object per line)") from None
    with f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a BOM is UTF-8 too
            except UnicodeDecodeError as err:
                raise SpeceeError(f"{path}:{line_no}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                  f"{err.start + 1}); save the file as UTF-8 JSONL") from None
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as err:
                raise SpeceeError(f"{path}:{line_no}: not valid JSON ({err.msg}); fix or remove that line") from None


def read_jsonl(path: Path, fields: tuple[str, ...] | dict[str, str] = ()) -> list[dict]:
    """Rows of a JSONL file; a bad line, a row without ``fields`` or (``fields`` a dict of field ->
    kind, see ROW_KINDS) a field of the wrong kind is one error naming file:line and the field."""
    rows = []
    for line_no, row in iter_jsonl(path):
        if not isinstance(row, dict):
            raise SpeceeError(f"{path}:{line_no}: expected a JSON object (one per line), got {_json_type(row)}")
        missing = [k for k in fields if k not in row]
        if missing:
            raise SpeceeError(f"{path}:{line_no}: missing field(s) {missing}")
        if isinstance(fields, dict):
            for key, kind in fields.items():
                check_kind(row[key], kind, f"{path}:{line_no}: field {key!r}")
        rows.append(row)
    return rows


def _json_type(value) -> str:
    """A value's type in JSON's words (a user wrote JSON, not Python)."""
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


# The kinds a prompt row's fields take, and how each is said in an error.
ROW_KINDS = {
    "text": ("a non-empty string", lambda v: isinstance(v, str) and bool(v.strip())),
    "turns": ("a non-empty list of non-empty strings",
              lambda v: isinstance(v, list) and bool(v) and all(isinstance(t, str) and t.strip() for t in v)),
    "id": ("a string or a whole number", lambda v: isinstance(v, str) and bool(v.strip())
           or isinstance(v, int) and not isinstance(v, bool)),
}


def check_kind(value, kind: str, where: str) -> None:
    expected, ok = ROW_KINDS[kind]
    if not ok(value):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise SpeceeError(f"{where} is {_json_type(value)} ({shown}); expected {expected}")


def unique_ids(prompts: list, where: list[str]) -> None:
    """Prompt ids key every per-prompt record (timings, exits, truncations): two rows with one id
    would silently merge. ``where`` names each prompt's row."""
    first: dict[str, str] = {}
    for p, at in zip(prompts, where):
        if p.id in first:
            raise SpeceeError(f"{at}: prompt id {p.id!r} repeats the id of {first[p.id]}; give every row its "
                              "own id")
        first[p.id] = at


def spec_bench_prompts(root, categories: list[str] | None = None, count: int | None = None,
                       offset: int = 0, per_category: bool = True) -> list[Prompt]:
    """Spec-Bench questions; with ``per_category`` the first ``count`` of each category."""
    path = data_file(root, SPEC_BENCH)
    rows = read_jsonl(path, {"question_id": "id", "category": "text", "turns": "turns"})
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


def instruction_pairs(root, sources: list[str] | None = None) -> tuple[list[tuple[str, str]], dict]:
    """(prompt, response) pairs from the instruction sets, and {file: sha256}."""
    pairs, shas = [], {}
    for name in sources or list(INSTRUCTION_FILES):
        if name not in INSTRUCTION_FILES:
            raise SpeceeError(f"unknown instruction source {name!r}; valid: {sorted(INSTRUCTION_FILES)}")
        path = data_file(root, INSTRUCTION_FILES[name])
        shas[INSTRUCTION_FILES[name]] = sha256(path)
        if path.suffix == ".jsonl":
            rows = [(f"{path}:{n}", r) for n, r in iter_jsonl(path)]
        else:
            doc = _read_json_file(path)
            if not isinstance(doc, list):
                raise SpeceeError(f"{path}: expected a JSON array of instruction records, got {_json_type(doc)}")
            rows = [(f"{path} [{i}]", r) for i, r in enumerate(doc)]
        for where, r in rows:
            if not isinstance(r, dict):
                raise SpeceeError(f"{where}: expected a JSON object, got {_json_type(r)}")
            need = ("prompt", "answer") if "prompt" in r else ("instruction",)
            for key in need:
                if key not in r:
                    raise SpeceeError(f"{where}: missing field {key!r}")
            for key in ("prompt", "answer", "instruction", "input", "response", "output"):
                if r.get(key) is not None and not isinstance(r[key], str):
                    raise SpeceeError(f"{where}: field {key!r} is {_json_type(r[key])}; expected text")
            if "prompt" in r:  # dolly: already an Alpaca-style prompt
                pairs.append((r["prompt"].strip(), r["answer"].strip()))
            else:
                prompt = r["instruction"].strip() + (f"\n\n{r['input'].strip()}" if r.get("input") else "")
                pairs.append((prompt, (r.get("response") or r.get("output") or "").strip()))
    return [p for p in pairs if p[0] and p[1]], shas


def _read_json_file(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError:
        raise SpeceeError(f"{path}: not UTF-8 text; save it as UTF-8 JSON") from None
    except json.JSONDecodeError as err:
        raise SpeceeError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None


def story_openings(root, count: int, words: int = 12) -> tuple[list[Prompt], dict]:
    """Openings of held-out TinyStories (the continuation slice, never used for training)."""
    path = data_file(root, TINYSTORIES_CONTINUATION)
    paras = [fix_mojibake(p).strip() for p in re.split(r"\n\s*\n", path.read_text(encoding="utf-8-sig"))]
    starts = [p for p in paras if len(p.split()) > 2 * words][:count]
    prompts = [Prompt(f"story{i}", "tinystories", [" ".join(p.split()[:words])]) for i, p in enumerate(starts)]
    return prompts, {TINYSTORIES_CONTINUATION: sha256(path)}


def calibration_prompts(root, c) -> tuple[list[Prompt], dict]:
    """Prompts for predictor training and exit profiling, disjoint from evaluation: Spec-Bench
    from ``c.spec_bench_offset`` on (evaluation reads lower offsets) + held-out story openings."""
    cats = list(c.spec_bench_categories) if c.get("spec_bench_categories") else None
    spec = spec_bench_prompts(root, cats, c.spec_bench_count, c.spec_bench_offset)
    if cats:  # in the order asked for (a token target takes the first ones)
        spec = sorted(spec, key=lambda p: cats.index(p.category))
    stories, files = story_openings(root, c.story_prompts)
    files[SPEC_BENCH] = sha256(data_file(root, SPEC_BENCH))
    return spec + stories, files


SOURCES = ("spec_bench", "mt_bench", "gsm8k", "humaneval", "alpaca", "jsonl", "hf")


def _jsonl(root, rel, fields: dict[str, str]) -> list[dict]:
    path = data_file(root, rel)
    rows = read_jsonl(path, fields)
    if not rows:
        raise SpeceeError(f"{path} is empty; check paths.data_root")
    return rows


def load_prompt_set(root, d) -> list[Prompt]:
    """The prompts of a ``dataset`` config node (source, categories, count, offset)."""
    if d.source == "spec_bench":
        return spec_bench_prompts(root, d.categories, d.count, d.offset)
    if d.source == "mt_bench":
        prompts = [Prompt(f"mt{r['question_id']}", r["category"], list(r["turns"])) for r in _jsonl(root, MT_BENCH, {"question_id": "id", "category": "text", "turns": "turns"})]
        if d.categories:
            prompts = [p for p in prompts if p.category in d.categories]
    elif d.source == "gsm8k":
        prompts = [Prompt(f"gsm8k{i}", "gsm8k", [r["question"]]) for i, r in enumerate(_jsonl(root, "gsm8k/test.jsonl", {"question": "text"}))]
    elif d.source == "humaneval":
        prompts = [Prompt(r["task_id"], "humaneval", [r["prompt"]]) for r in _jsonl(root, "humaneval/HumanEval.jsonl", {"task_id": "id", "prompt": "text"})]
    elif d.source == "alpaca":
        pairs, _ = instruction_pairs(root, ["alpaca_gpt4_demo"])
        prompts = [Prompt(f"alpaca{i}", "alpaca", [p]) for i, (p, _) in enumerate(pairs)]
    elif d.source == "jsonl":
        prompts = user_jsonl_prompts(d)
    elif d.source == "hf":
        prompts = user_hf_prompts(d)
    else:
        raise SpeceeError(f"dataset.source={d.source!r} is unknown; valid: {', '.join(SOURCES)}")
    prompts = prompts[d.offset:d.offset + d.count] if d.count else prompts[d.offset:]
    if not prompts:
        raise SpeceeError("the prompt selection is empty; check dataset.categories / count / offset")
    return prompts


def _row_prompt(row, d, where: str, index: int) -> Prompt:
    """One user row -> Prompt; ``where`` names the row (file:line) in every error."""
    if not isinstance(row, dict):
        raise SpeceeError(f"{where}: expected a JSON object, got {_json_type(row)}")
    key, setting = (d.turns_field, "dataset.turns_field") if d.turns_field else (d.field, "dataset.field")
    if key not in row:
        raise SpeceeError(f"{where}: no key {key!r} ({setting}); keys: {sorted(map(str, row))}")
    turns = row[key]  # a string is one turn, under either key
    if isinstance(turns, list):
        check_kind(turns, "turns", f"{where}: {key!r} ({setting})")
    elif not ROW_KINDS["text"][1](turns):
        raise SpeceeError(f"{where}: the prompt must be a non-empty string or a list of non-empty strings; "
                          f"{key!r} ({setting}) is {_json_type(turns)} ({str(turns)[:40]!r})")
    turns = [turns] if isinstance(turns, str) else turns
    category = "all"
    if d.category_field:
        if d.category_field not in row:
            raise SpeceeError(f"{where}: no key {d.category_field!r} (dataset.category_field)")
        check_kind(row[d.category_field], "id", f"{where}: {d.category_field!r} (dataset.category_field)")
        category = str(row[d.category_field])
    if d.id_field and d.id_field not in row:
        raise SpeceeError(f"{where}: no key {d.id_field!r} (dataset.id_field)")
    if d.id_field:
        check_kind(row[d.id_field], "id", f"{where}: {d.id_field!r} (dataset.id_field)")
    pid = str(row[d.id_field]) if d.id_field else f"{d.name}{index}"
    return Prompt(pid, category, turns)


def user_jsonl_prompts(d) -> list[Prompt]:
    """A JSONL file of prompts in any shape (``dataset=jsonl dataset.path=FILE dataset.field=KEY``)."""
    from specee.io import project_path
    path = project_path(d.path)
    if not path.is_file():
        raise SpeceeError(f"dataset.path={d.path}: no such file ({path})")
    prompts, where = [], []
    for line_no, row in iter_jsonl(path):
        where.append(f"{path}:{line_no}")
        prompts.append(_row_prompt(row, d, where[-1], len(prompts)))
    if not prompts:
        raise SpeceeError(f"dataset.path={d.path} holds no prompts")
    unique_ids(prompts, where)
    return prompts


def user_hf_prompts(d) -> list[Prompt]:
    """A local datasets folder (``save_to_disk`` output, or data files ``load_dataset`` reads) or,
    with ``dataset.allow_hub=true``, a hub id (``dataset=hf dataset.path=... dataset.field=...``)."""
    import os

    from specee.io import project_path
    local = project_path(d.path)
    if not local.exists() and not d.allow_hub:
        raise SpeceeError(f"dataset.path={d.path} is not a local folder ({local} does not exist); "
                          "set dataset.allow_hub=true to let the datasets library download a hub dataset")
    if not d.allow_hub:
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets
    try:
        if local.is_dir() and ((local / "state.json").is_file() or (local / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if d.split not in ds:
                    raise SpeceeError(f"dataset.split={d.split} is not in {local}; splits: {sorted(ds)}")
                ds = ds[d.split]
        else:
            ds = datasets.load_dataset(str(local) if local.exists() else d.path, split=d.split)
    except SpeceeError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets raises many types; one message for all
        raise SpeceeError(f"dataset.path={d.path} (split {d.split}) cannot be read by datasets: "
                          f"{type(err).__name__}: {err}") from None
    where = [f"{d.path} [{d.split}] row {i}" for i in range(len(ds))]
    prompts = [_row_prompt(row, d, where[i], i) for i, row in enumerate(ds)]
    if not prompts:
        raise SpeceeError(f"dataset.path={d.path} (split {d.split}) holds no prompts")
    unique_ids(prompts, where)
    return prompts
