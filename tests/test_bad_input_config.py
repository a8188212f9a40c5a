"""The generated bad-input matrix for configuration: every field of every schema in
specee.config.SCHEMAS (and the root config's own), read from the dataclasses, gets values of the
wrong type, out of its declared range, empty and absurd; every level gets unknown keys with and
without `+`; every option name of every group is selected, the `*_schema` entries included; and
the rules across fields are probed. Each bad case must be one SpeceeError: a single line naming
the key (or option) it is about, raised by the same checks run.py runs before any work.

The space is sampled with a fixed seed (the same cases on every run); SPECEE_BAD_INPUT_EXHAUSTIVE=1
runs every generated case and more hypothesis examples."""
from __future__ import annotations

import copy
import dataclasses
import os
import random
import tempfile
import typing

import pytest

# hypothesis keeps a cache folder; keep it out of the working tree
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "specee-hypothesis"))
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specee import config as C
from specee.errors import SpeceeError, one_line
from specee.launch import check_config, compose_and_check, explain

FAST_TIER_SAMPLE = 8  # the fast tier runs one in 8 of this matrix's cases (tests/conftest.py)

EXHAUSTIVE = os.environ.get("SPECEE_BAD_INPUT_EXHAUSTIVE") == "1"
SEED = 24
PER_FIELD = 3  # sampled bad values per field (the exhaustive mode takes all)
HYPOTHESIS = settings(derandomize=True, deadline=None, max_examples=200 if EXHAUSTIVE else 25,
                      suppress_health_check=list(HealthCheck), database=None)

C.register()


# -- composition: Hydra's own compose for option choices, its own override step for keys -------
_BASES: dict[tuple, object] = {}


def _base(options: tuple[str, ...]):
    """The composed config of these option choices (cached: composing is the slow part)."""
    if options not in _BASES:
        _BASES[options] = compose_and_check(list(options))
    return _BASES[options]


def check(options: tuple[str, ...], overrides: list[str]):
    """What run.py does for `options + overrides`: the key overrides are applied by the step
    Hydra's compose applies them with (ConfigLoaderImpl._apply_overrides_to_config) to the
    composed options, then the project's checks. Returns the SpeceeError, or None if accepted."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    try:
        cfg = copy.deepcopy(_base(options))
        try:
            parsed = OverridesParser.create().parse_overrides(overrides)
            ConfigLoaderImpl._apply_overrides_to_config(parsed, cfg)
        except SpeceeError:
            raise
        except Exception as err:  # noqa: BLE001 - what compose_and_check translates
            raise SpeceeError(explain(err, list(options) + overrides)) from None
        check_config(cfg)
    except SpeceeError as err:
        return err
    return None


def assert_refused(err, *names):
    assert err is not None, f"accepted; expected an error naming {names}"
    msg = str(err)
    assert len(msg.splitlines()) == 1 and msg == one_line(msg), f"not one line: {msg!r}"
    assert any(n in msg for n in names), f"{names} not named in: {msg}"


# -- the schemas' fields, from the dataclasses --------------------------------------------------
def _fields(cls):
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def _unwrap(hint):
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def schema_bases() -> list[tuple[str, type, tuple[str, ...]]]:
    """(key prefix, schema, options that compose it cleanly) for every schema in SCHEMAS and
    every dataclass the root config holds directly (early_exit, paths, the root itself)."""
    out = []
    for (group, _), cls in C.SCHEMAS.items():
        for opt in C.options(group):
            if C.option_schema(group, opt) is cls:
                try:
                    _base((f"{group}={opt}",))
                except SpeceeError:
                    continue  # e.g. a 7B model option without model.path
                out.append((f"{group}.", cls, (f"{group}={opt}",)))
                break
        else:
            out.append((f"{group}.", cls, None))  # reported by test_every_schema_has_a_usable_option
    for name, hint in _fields(C.Config):
        if dataclasses.is_dataclass(hint):
            out.append((f"{name}.", hint, ()))
    out.append(("", C.Config, ()))
    return out


def leaf_fields(prefix, cls):
    """(dotted key, type hint, owning schema, field name) of every non-dataclass field, nested
    dataclasses (experiment.calibration) included; the root's group nodes are covered per schema."""
    for name, hint in _fields(cls):
        if cls is C.Config and name in ("model", "ablation", "draft", "placement", "dataset", "runtime",
                                        "experiment", "early_exit", "paths"):
            continue
        if dataclasses.is_dataclass(hint):
            yield from leaf_fields(f"{prefix}{name}.", hint)
        else:
            yield f"{prefix}{name}", hint, cls, name


def bad_values(hint, cls, name) -> list[tuple[str, str]]:
    """(class, override value) pairs that the schema's declared type, range or choices rule out."""
    base, optional = _unwrap(hint)
    choices = C.CHOICES.get(cls, {}).get(name)
    limits = C.LIMITS.get(cls, {}).get(name)
    out = [] if optional or base is typing.Any else [("empty", "null")]
    if name == "_target_":
        return out + [("absurd", "os.system"), ("empty", "''")]
    if base is int:
        lo, hi = limits or (0, C.INT_MAX)
        out += [("type", "abc"), ("type", "1.5"), ("type", "[1]"), ("type", "{a:1}"),
                ("range", str(lo - 1)), ("range", str(hi + 1)), ("absurd", str(10**30)), ("absurd", "-99999999999")]
    elif base is float:
        lo, hi = limits or (0.0, C.FLOAT_MAX)
        out += [("type", "abc"), ("type", "[0.5]"), ("type", "{a:1}"), ("range", repr(lo - 0.5)),
                ("range", repr(hi * 2 + 1)), ("absurd", "nan"), ("absurd", "inf"), ("absurd", "-inf"),
                ("absurd", "1e300")]
    elif base is bool:
        out += [("type", "maybe"), ("type", "[true]"), ("type", "{a:1}")]
    elif base is str:
        out += [("type", "[a,b]"), ("type", "{a:1}"), ("empty", "''"), ("empty", "'   '")]
        if choices is not None:
            out += [("absurd", "not_a_choice_24"), ("absurd", "'DROP TABLE'")]
    elif base is typing.Any and name == "tree":  # a draft tree (ablation.tree, model.tree): what no reading accepts
        out += [("type", "5"), ("type", "{a:1}"), ("absurd", "not_a_tree_24"), ("range", "[[-1]]"),
                ("absurd", "[[0,1]]"), ("empty", "['']")]
    elif base is typing.Any:  # a whole number or auto (ablation.num_tokens, ablation.exit_layer)
        out += [("type", "abc"), ("type", "1.5"), ("type", "{a:1}"), ("range", "0"), ("range", "-3"),
                ("absurd", str(10**30))]
    elif typing.get_origin(base) is list:
        out += [("type", "abc"), ("type", "{a:1}"), ("type", "[[a]]"), ("empty", "['']")]
        if choices is not None:
            out += [("absurd", "[not_an_option_24]")]
    return out


def field_cases():
    cases = []
    for prefix, cls, opts in schema_bases():
        if opts is None:
            continue
        for key, hint, owner, name in leaf_fields(prefix, cls):
            for kind, value in bad_values(hint, owner, name):
                cases.append((opts, key, kind, value))
    return cases


ALL_FIELD_CASES = field_cases()


def _sample(cases, k_per_key):
    """A fixed-seed sample with every key and every class of bad value kept."""
    if EXHAUSTIVE:
        return cases
    rng = random.Random(SEED)
    by_key: dict[str, list] = {}
    for c in cases:
        by_key.setdefault(c[1], []).append(c)
    out = []
    for key, group in by_key.items():
        kinds = {}
        for c in rng.sample(group, len(group)):
            kinds.setdefault(c[2], c)  # one of each class first
        picked = list(kinds.values())[:k_per_key]
        out += picked
    return out


FIELD_CASES = _sample(ALL_FIELD_CASES, PER_FIELD)


def test_every_schema_has_a_usable_option():
    """A schema no option composes from would escape the matrix."""
    missing = [prefix + cls.__name__ for prefix, cls, opts in schema_bases() if opts is None]
    assert not missing, missing


def test_the_matrix_covers_every_field_of_every_schema():
    keys = {c[1] for c in ALL_FIELD_CASES}
    for prefix, cls, opts in schema_bases():
        for key, *_ in leaf_fields(prefix, cls):
            assert key in keys, key
    # the sampled run still touches every key and every class of bad value
    assert {c[1] for c in FIELD_CASES} == keys
    assert {c[2] for c in FIELD_CASES} == {"type", "range", "empty", "absurd"}


@pytest.mark.parametrize("options", sorted({c[0] for c in ALL_FIELD_CASES}), ids=lambda o: " ".join(o) or "default")
def test_each_base_is_accepted(options):
    """The control: a case fails because of its one bad value, not its base."""
    assert check(options, []) is None


@pytest.mark.parametrize("options,key,kind,value", FIELD_CASES,
                         ids=[f"{k}={v}[{kind}]" for _, k, kind, v in FIELD_CASES])
def test_bad_value_is_refused_naming_its_key(options, key, kind, value):
    assert_refused(check(options, [f"{key}={value}"]), key)


# -- unknown keys at every level, with and without `+` -------------------------------------------
def key_cases():
    cases = []
    for prefix, cls, opts in schema_bases():
        if opts is None:
            continue
        levels = [(prefix, cls)]
        levels += [(f"{prefix}{n}.", h) for n, h in _fields(cls) if dataclasses.is_dataclass(h)]
        for level, _ in levels:
            for plus in ("", "+", "++"):
                cases.append((opts, f"{plus}{level}colour_24=1", f"{level}colour_24"))
        leaf = next(f"{prefix}{n}" for n, h in _fields(cls) if not dataclasses.is_dataclass(h)
                    and _unwrap(h)[0] in (int, float, str, bool))
        cases.append((opts, f"+{leaf}.colour_24=1", leaf))  # a key below a value
    return cases


KEY_CASES = key_cases()


@pytest.mark.parametrize("options,override,key", KEY_CASES, ids=[o for _, o, _ in KEY_CASES])
def test_unknown_key_is_refused_however_added(options, override, key):
    assert_refused(check(options, [override]), key)


# -- every registered option name, the schema entries included -----------------------------------
def option_cases():
    from hydra.core.config_store import ConfigStore
    repo = ConfigStore.instance().repo
    groups = sorted({g for g, _ in C.SCHEMAS})
    cases = []
    for group in groups:
        stored = {n[:-5] for n in repo.get(group, {}) if n.endswith(".yaml")}
        for name in sorted(set(C.options(group)) | stored):
            cases.append((group, name, (group, name) in C.SCHEMAS))
        cases.append((group, "colour_24", True))
    return cases


OPTION_CASES = option_cases()


@pytest.mark.parametrize("group,name,bad", OPTION_CASES, ids=[f"{g}={n}" for g, n, _ in OPTION_CASES])
def test_every_option_name_composes_or_is_refused_in_one_line(group, name, bad):
    try:
        compose_and_check([f"{group}={name}"])
        err = None
    except SpeceeError as e:
        err = e
    if bad:  # a schema entry or an unknown name: refused with the valid options listed
        assert_refused(err, f"{group}={name}")
        assert all(o in str(err) for o in C.options(group)), str(err)
        assert "_schema" not in str(err).split("valid:")[1]
    elif err is not None:  # e.g. a 7B option needs model.path or a GPU: one line, about the model
        assert_refused(err, f"{group}=", f"{group}.")


def test_the_matrix_holds_the_schema_entries():
    assert {(g, n) for g, n, _ in OPTION_CASES} >= set(C.SCHEMAS)


# -- rules across fields -----------------------------------------------------------------------
@HYPOTHESIS
@given(k=st.integers(1, 8), ranks=st.lists(st.integers(0, 12), min_size=1, max_size=5),
       mode=st.sampled_from(["eagle", "specee_full"]))
def test_tree_ranks_beyond_top_k_are_refused_at_compose_time(k, ranks, mode):
    tree = "[" + ",".join(f"[{r}]" for r in sorted(set(ranks))) + "]"
    err = check((f"ablation={mode}",), [f"early_exit.k={k}", f"ablation.tree={tree}"])
    if max(ranks) >= k:
        assert_refused(err, "ablation.tree")
        assert "early_exit.k" in str(err)
    else:  # the tree is fine (specee_full may still refuse predictors trained for another K)
        assert err is None or ("ablation.tree" not in str(err) and "K=4" in str(err)), str(err)


@pytest.mark.parametrize("ablation", ["dense", "adainfer", "eagle"])
@pytest.mark.parametrize("placement", ["offline_topm", "online_only", "online_union"])
def test_a_placement_needs_a_specee_ablation(ablation, placement):
    assert_refused(check((f"ablation={ablation}", f"placement={placement}"), []), f"placement={placement}")


@pytest.mark.parametrize("ablation", ["dense", "adainfer", "eagle"])
def test_replay_needs_a_specee_mode(ablation):
    err = check((f"ablation={ablation}",), ["early_exit.replay=specee/artifacts/tiny_exit_profile"])
    assert_refused(err, "early_exit.replay")


@HYPOTHESIS
@given(n=st.integers(1024, 10**6))
def test_a_generation_budget_must_leave_room_for_a_prompt(n):
    assert_refused(check((), [f"dataset.max_new_tokens={n}"]), "dataset.max_new_tokens")


@pytest.mark.parametrize("override,key", [("experiment.max_gen_tokens=1024", "experiment.max_gen_tokens"),
                                          ("experiment.max_length=1025", "experiment.max_length")])
def test_accuracy_budgets_fit_the_context(override, key):
    assert_refused(check(("experiment=accuracy",), [override]), key)


INT_FIELDS = sorted({(opts, key, *(C.LIMITS.get(owner, {}).get(name) or (0, C.INT_MAX)))
                     for prefix, cls, opts in schema_bases() if opts is not None
                     for key, hint, owner, name in leaf_fields(prefix, cls) if _unwrap(hint)[0] is int})


@HYPOTHESIS
@given(data=st.data())
def test_any_int_outside_a_declared_range_is_refused(data):
    """Beyond the listed edges: any integer outside a field's declared range."""
    opts, key, lo, hi = data.draw(st.sampled_from(INT_FIELDS))
    value = data.draw(st.one_of(st.integers(max_value=lo - 1), st.integers(min_value=hi + 1)))
    assert_refused(check(opts, [f"{key}={value}"]), key)


def test_every_bad_value_class_is_in_the_matrix():
    assert {c[2] for c in ALL_FIELD_CASES} == {"type", "range", "empty", "absurd"}
    assert len(INT_FIELDS) > 20


_SAME = random.Random(SEED).sample(FIELD_CASES, 8) + random.Random(SEED).sample(KEY_CASES, 4)


@pytest.mark.parametrize("case", _SAME, ids=lambda c: c[1] if len(c) == 3 else f"{c[1]}={c[3]}")
def test_the_in_process_path_is_run_pys_path(case):
    """The matrix applies key overrides with Hydra's own override step to a composed base; a
    sample of cases through the full compose gives the same error."""
    if len(case) == 3:
        options, override, _ = case
    else:
        options, key, _, value = case
        override = f"{key}={value}"
    fast = check(options, [override])
    with pytest.raises(SpeceeError) as full:
        compose_and_check([*options, override])
    assert fast is not None and str(full.value) == str(fast)
