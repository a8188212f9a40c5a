"""Write docs/reference.md from the code: every config group's options (conf/), every config field
with its default and allowed values (the schemas, LIMITS and CHOICES of specee.config) and the
metrics a speed results.json carries (specee/bench/metrics_catalog.py).

    python scripts/gen_reference.py           # rewrite docs/reference.md
    python scripts/gen_reference.py --check   # exit 1 when the committed page is stale

The page is generated so that it cannot go stale: tests/test_docs.py fails when the committed
page differs from what this script writes (a config option or field added without rerunning it).
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference.md"
sys.path.insert(0, str(ROOT))

# The groups a command line selects (conf/<group>/), in the order a reader meets them.
GROUPS = ("experiment", "model", "ablation", "placement", "draft", "runtime", "dataset")
# The defaults that apply to a field with no declared range or choices (the harness's one check
# walk gives every int, float and str field these; see specee.config's check_fields).
INT_DEFAULT = "integer >= 0"
FLOAT_DEFAULT = "finite number in [0, 1e+06]"
STR_DEFAULT = "non-empty one-line text"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _yaml_text(value) -> str:
    """A default as it would be written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_yaml_text(v) for v in value) + "]"
    return str(value)


def option_summary(group: str, name: str) -> str:
    """The first sentence of the option file's leading comment (the YAML's own description)."""
    path = ROOT / "conf" / group / f"{name}.yaml"
    if not path.is_file():
        return ""
    words = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith("@package"):
            continue
        words.append(text)
    text = " ".join(w for w in words if w) or recipe_summary(group, name)
    m = re.match(r"(.+?\.)(\s|$)", text)
    return (m.group(1) if m else text).rstrip(":")


def _schema_of_option(group: str, name: str):
    """The schema an option starts from: the `*_schema` entry of its YAML's defaults list."""
    import yaml
    from specee.config import SCHEMAS
    doc = yaml.safe_load((ROOT / "conf" / group / f"{name}.yaml").read_text(encoding="utf-8")) or {}
    for entry in doc.get("defaults") or []:
        if isinstance(entry, str) and (group, entry) in SCHEMAS:
            return SCHEMAS[group, entry]
    return None


def recipe_summary(group: str, name: str) -> str:
    """An experiment option without its own comment: the first line of its recipe's docstring."""
    import importlib
    if group != "experiment":
        return ""
    schema = _schema_of_option(group, name)
    target = next((f.default for f in dataclasses.fields(schema) if f.name == "_target_"), None) if schema else None
    if not target:
        return ""
    doc = inspect.getdoc(importlib.import_module(target.rsplit(".", 1)[0])) or ""
    first = doc.split("\n\n")[0].replace("\n", " ")
    text = re.sub(r"^Recipe:\s*", "", first).strip()
    return text[:1].upper() + text[1:]


def option_settings(group: str, name: str) -> str:
    """What an option sets: its YAML's keys (for a global-package option, those under the group)."""
    import yaml
    path = ROOT / "conf" / group / f"{name}.yaml"
    if not path.is_file():
        return ""
    doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    picks = [e for e in doc.get("defaults") or [] if isinstance(e, dict)]
    body = {k: v for k, v in doc.items() if k not in ("defaults", "name")}
    if group in body and isinstance(body[group], dict):  # `# @package _global_` options
        inner = {k: v for k, v in body.pop(group).items() if k != "name"}
        body = {**inner, **{k: v for k, v in body.items()}}
    parts = [f"{k.replace('override /', '')}={v}" for e in picks for k, v in e.items()]
    parts += [f"{k}={_yaml_text(v)}" for k, v in body.items() if not isinstance(v, dict)]
    parts += [f"{k}.{kk}={_yaml_text(vv)}" for k, v in body.items() if isinstance(v, dict)
              for kk, vv in v.items() if not isinstance(vv, dict)]
    return ", ".join(f"`{p}`" for p in parts)


def field_comments(cls) -> dict:
    """Each field's comment in its dataclass: the trailing `# ...` on its line, else the comment
    lines just above it (the schemas document themselves there)."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out, above = {}, []
    for line in lines[1:]:
        s = line.strip()
        if s.startswith("#"):
            above.append(s.lstrip("#").strip())
            continue
        m = re.match(r"(\w+)\s*:\s*[^=]+?(?:=\s*(.*))?$", s)
        if m and not s.startswith(("def ", "class ", "@", '"""')):
            name, rest = m.group(1), m.group(2) or ""
            trailing = re.search(r"\s#\s*(.*)$", rest)
            text = trailing.group(1) if trailing else " ".join(above)
            out.setdefault(name, re.sub(r"\s+", " ", text).strip())
        above = [] if not s.startswith("#") else above
    return out


def _base(hint):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def type_text(hint) -> str:
    base, optional = _base(hint)
    if base is typing.Any:
        text = "any"
    elif typing.get_origin(base) is list:
        kind = (typing.get_args(base) or (typing.Any,))[0]
        text = f"list[{getattr(kind, '__name__', str(kind))}]"
    else:
        text = getattr(base, "__name__", str(base))
    return text + (" or null" if optional else "")


def allowed_text(cls, name: str, hint) -> str:
    from specee.config import CHOICES, LIMITS, options
    choice = CHOICES.get(cls, {}).get(name)
    base, optional = _base(hint)
    null = ", or null" if optional else ""
    if choice is not None:
        kind = type(choice).__name__
        if kind == "Options":
            return f"options of `{choice.group}`: " + ", ".join(options(choice.group)) + null
        if kind == "Pattern":
            return choice.text + null
        values = choice() if callable(choice) else choice
        return ", ".join(str(v) for v in values) + null
    limits = LIMITS.get(cls, {}).get(name)
    if base is bool:
        return "true, false" + null
    if base is int:
        return (f"integer in [{limits[0]}, {limits[1]}]" if limits else INT_DEFAULT) + null
    if base is float:
        return (f"number in [{limits[0]:g}, {limits[1]:g}]" if limits else FLOAT_DEFAULT) + null
    if base is str:
        return STR_DEFAULT + null
    if typing.get_origin(base) is list:
        return "a list, e.g. `[a,b]`" + null
    return "see its description" + null


def default_text(f) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(set by the option)"
    if dataclasses.is_dataclass(value):
        return "(nested, below)"
    if value == "???":
        return "(set by the option)"
    return f"`{_yaml_text(value)}`"


def field_table(cls, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    notes = field_comments(cls)
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name == "_target_":
            continue  # fixed by the option itself
        hint = hints[f.name]
        if dataclasses.is_dataclass(_base(hint)[0]):
            rows.append(f"| `{prefix}{f.name}` | {_base(hint)[0].__name__} | (nested, below) | – | "
                        f"{_cell(notes.get(f.name, ''))} |")
            continue
        if hint is typing.Any and prefix == "" and f.name in GROUPS:
            continue  # a config group: its options are listed above
        rows.append(f"| `{prefix}{f.name}` | {_cell(type_text(hint))} | {_cell(default_text(f))} | "
                    f"{_cell(allowed_text(cls, f.name, hint))} | {_cell(notes.get(f.name, ''))} |")
    return rows


def _nested(cls) -> list:
    hints = typing.get_type_hints(cls)
    return [(f.name, _base(hints[f.name])[0]) for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(_base(hints[f.name])[0])]


def schema_sections() -> list[str]:
    from specee.config import SCHEMAS, Config
    out = []
    seen = set()
    root = [(None, "the root (any command)", Config, "")]
    by_group = [(g, f"{g} options starting from `{name}`", cls, f"{g}.")
                for (g, name), cls in sorted(SCHEMAS.items(), key=lambda kv: (GROUPS.index(kv[0][0])
                                                                                if kv[0][0] in GROUPS else 99, kv[0][1]))]
    for group, title, cls, prefix in root + by_group:
        stack = [(title, cls, prefix)]
        while stack:
            title, cls, prefix = stack.pop(0)
            if (cls, prefix) in seen:
                continue
            seen.add((cls, prefix))
            out += [f"### `{prefix.rstrip('.') or 'root'}`: {cls.__name__}", "", f"Applies to {title}.", ""]
            out += field_table(cls, prefix) + [""]
            stack += [(f"`{prefix}{name}`", sub, f"{prefix}{name}.") for name, sub in _nested(cls)]
    return out


def option_sections() -> list[str]:
    from specee.config import SCHEMAS, options
    out = []
    for group in GROUPS:
        names = options(group)
        schema = next((n for g, n in SCHEMAS if g == group), None)
        out += [f"### `{group}`", "", f"{len(names)} options: " + ", ".join(f"`{n}`" for n in names) + ".", ""]
        out += ["| option | what it is | what it sets |", "|---|---|---|"]
        out += [f"| `{group}={n}` | {_cell(option_summary(group, n))} | {_cell(option_settings(group, n))} |"
                for n in names]
        out += [""]
        if schema is None:
            continue
    launchers = sorted(p.stem for p in (ROOT / "conf" / "hydra" / "launcher").glob("*.yaml"))
    out += ["### `hydra/launcher`", "",
            "`subprocess` (the default: one process per sweep job on this machine, from hydra_plugins/)"
            + "".join(f", `{n}` ({option_summary('hydra/launcher', n) or 'submitit'})" for n in launchers) + ".", ""]
    return out


def render() -> str:
    from specee.bench.metrics_catalog import render_markdown
    lines = [
        "# Reference",
        "",
        "<!-- Generated by scripts/gen_reference.py from conf/, specee.config and "
        "specee/bench/metrics_catalog.py. Do not edit by hand: rerun the script. -->",
        "",
        "Every config group's options, every config field with its default and allowed values, and the",
        "metrics of a speed `results.json`. Set a field on the command line as `key=value`",
        "(`python run.py experiment=speed dataset.count=4`); a key no schema declares, a value of the",
        "wrong type or outside its range is refused before any work with one `specee: error:` line.",
        "",
        "## Config groups and their options",
        "",
    ]
    lines += option_sections()
    lines += ["## Config fields", "",
              f"Defaults where a field declares no range: an integer is `{INT_DEFAULT}`, a number a "
              f"`{FLOAT_DEFAULT}`, text `{STR_DEFAULT}`. `${{...}}` defaults are interpolations resolved "
              "when the config is composed.", ""]
    lines += schema_sections()
    lines += ["## Metrics of a speed results.json", "",
              "Keys under `metrics` (see [the results contract](results.md) for an example file).", ""]
    lines += [render_markdown()]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/gen_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
