"""Rules across config groups: what a single field's range or allowed values cannot express.

Each field on its own is checked first (specee/config/checks.py), so these rules may rely on
every value being one its field allows. What a mode needs comes from its spec
(specee/decoding/modes.py), what a recipe needs from its schema's ``facts``.
"""
from __future__ import annotations

from omegaconf import OmegaConf

from specee.config.checks import check_declared_keys, check_fields, options, schema_of
from specee.config.schemas import SCHEMAS, recipe, recipe_name
from specee.errors import SpeceeError


def validate(cfg) -> None:
    """Every value, then the rules across groups; each message says what to change."""
    from specee.decoding import modes
    check_declared_keys(cfg)
    check_target(cfg)  # the rules below read the recipe from it
    check_fields(cfg)  # each value on its own first: the rules below may then rely on them
    a, facts = cfg.ablation, recipe(cfg)
    spec = modes.of(a)
    tree = spec.is_tree(a)
    if cfg.early_exit.replay and not spec.needs_bank:
        raise SpeceeError(f"early_exit.replay replays SpecEE exit decisions; ablation={a.name} "
                          "has none (use specee_t1, specee_t1_t2 or specee_full)")
    if a.decoding == "tree" and spec.tree == modes.TREE_NEVER and (spec.costs.block_cost or spec.speed_only):
        raise SpeceeError(f"ablation.mode={a.mode} verifies one proposal per step; set ablation.decoding=autoregressive")
    if a.decoding == "tree" and spec.tree == modes.TREE_NEVER:
        raise SpeceeError(f"ablation.decoding=tree needs a draft-tree mode ("
                          f"{', '.join(n for n in modes.names() if modes.spec(n).tree != modes.TREE_NEVER)}), "
                          f"not {a.mode}")
    if spec.tree == modes.TREE_ALWAYS and not tree:
        raise SpeceeError(f"ablation.mode={a.mode} is tree speculative decoding; set ablation.decoding=tree")
    check_peer_settings(cfg)
    if a.classifier != "svm" and not spec.needs_adainfer:
        raise SpeceeError(f"ablation.classifier={a.classifier} selects AdaInfer's exit classifier; ablation={a.name} "
                          f"(mode {a.mode}) has none (use ablation=adainfer_crf)")
    if a.tree_select == "auto" and not tree:
        raise SpeceeError(f"ablation.tree_select=auto chooses a draft tree; ablation={a.name} decodes without one "
                          "(use eagle or a tree SpecEE ablation such as specee_full)")
    if a.tree_select == "auto" and cfg.runtime.kind == "compiled" and a.tree_max_nodes + 1 > cfg.runtime.max_block:
        raise SpeceeError(f"ablation.tree_max_nodes={a.tree_max_nodes} needs blocks of {a.tree_max_nodes + 1} tokens, "
                          f"beyond runtime.max_block={cfg.runtime.max_block}; lower one or raise the other")
    needs_draft = (facts.decodes and spec.needs_draft) or facts.needs_draft
    if cfg.draft.vocab_size and cfg.draft.name == "none":
        raise SpeceeError("draft.vocab_size reduces a draft head's vocabulary; draft=none has none "
                          "(use draft=eagle, or draft.vocab_size=0)")
    if needs_draft and cfg.draft.name == "none":
        raise SpeceeError(f"ablation={a.name} needs a draft head; use draft=eagle "
                          "(draft.path=... for an EAGLE-1 checkpoint)")
    if cfg.placement.name != "all_layers" and not spec.needs_bank:
        raise SpeceeError(f"placement={cfg.placement.name} schedules SpecEE predictors; it needs a "
                          f"SpecEE ablation (specee_t1, specee_t1_t2), not ablation={a.name}")
    if cfg.placement.coverage == 0:  # the field's range is [0, 1]; a share of no exits selects nothing
        raise SpeceeError(f"placement.coverage={cfg.placement.coverage} must lie in (0, 1]")
    check_dataset(cfg.dataset)
    if cfg.runtime.kind != "eager" and not facts.takes_runtime:
        takes = [cls.__dataclass_fields__["_target_"].default.split(".")[1] for (group, _), cls in SCHEMAS.items()
                 if group == "experiment" and cls.facts.takes_runtime]
        raise SpeceeError(f"runtime={cfg.runtime.name} applies to experiment={', '.join(takes)}; training, "
                          "profiling and collection run on the eager reference (the main job runs its "
                          "compiled variants from experiment.runtime_variants)")
    check_exit_control(cfg)
    check_tree(cfg)
    if recipe_name(cfg) == "reproduce":
        check_reproduce(cfg.experiment)
    if recipe_name(cfg) == "frontier":
        check_frontier(cfg.experiment)


def check_budget(delta: float, epsilon: float, delta_name: str = "experiment.delta") -> None:
    """Both in (0, 1), else one line naming the fix."""
    for name, v in ((delta_name, delta), ("experiment.epsilon", epsilon)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 1:
            shown = name if name.endswith("which") else f"{name}={v!r}"
            raise SpeceeError(f"{shown} must lie strictly between 0 and 1 (a loss budget and an error "
                              "rate: e.g. experiment.delta=0.01 experiment.epsilon=0.05)")


def check_frontier(e) -> None:
    """A loss budget and an error rate strictly inside (0, 1); a grid of at least two points per knob."""
    check_budget(e.delta, e.epsilon)
    for d in e.extra_deltas:
        check_budget(d, e.epsilon, f"experiment.extra_deltas has {d}, which")
    if not 0.0 < e.calibration_share < 1.0:
        raise SpeceeError(f"experiment.calibration_share={e.calibration_share} leaves a split empty; give a share "
                          "strictly between 0 and 1 (e.g. experiment.calibration_share=0.5)")
    if not 0.0 < e.fit_share < 1.0:
        raise SpeceeError(f"experiment.fit_share={e.fit_share} leaves a fitted policy nothing to fit on or to "
                          "calibrate on; give a share strictly between 0 and 1 (e.g. experiment.fit_share=0.25)")
    if e.max_new_tokens < 2:
        raise SpeceeError(f"experiment.max_new_tokens={e.max_new_tokens}: a frontier needs at least 2 (the first "
                          "token comes from the prefill, which never exits), e.g. experiment.max_new_tokens=32")
    for key in ("threshold_grid", "precision_grid", "margin_grid", "p_stop_grid", "real_only_grid", "oracle_budgets"):
        if key != "real_only_grid" and len(e[key]) < 2 or key == "real_only_grid" and e.real_only and not e[key]:
            raise SpeceeError(f"experiment.{key} has {len(e[key])} point(s); a frontier needs at least two "
                              f"(e.g. experiment.{key}=[{', '.join(str(v) for v in FRONTIER_EXAMPLES[key])}])")
    from specee.evaluation import registry
    unknown = [t for t in e.tasks if t not in registry.available()]
    if unknown and e.task_source == "shipped" and not e.include_path:  # others resolve in lm-eval's TaskManager
        raise SpeceeError(f"experiment.tasks has {unknown[0]!r}, not a shipped task; valid: "
                          f"{', '.join(sorted(registry.available()))} (your own: experiment.include_path=<folder "
                          "of task YAMLs>; lm-eval's: experiment.task_source=lm_eval)")
    if not e.policies:
        raise SpeceeError("experiment.policies is empty: name at least one early-exit ablation, e.g. [specee_t1_t2]")


FRONTIER_EXAMPLES = {"threshold_grid": [0.9, 0.5, 0.2], "precision_grid": [0.95, 0.8], "margin_grid": [0.5, 0.0],
                     "p_stop_grid": [0.9, 0.5], "real_only_grid": [0.8, 0.4], "oracle_budgets": [0.0, 0.05]}


def check_reproduce(e) -> None:
    if e.bank not in ("trained", "authors", "auto"):
        raise SpeceeError(f"experiment.bank={e.bank!r} is unknown; valid: trained, authors, auto")
    for key in ("speed_overrides", "accuracy_overrides"):
        bad = next((o for o in e[key] if "=" not in o or o.startswith(("-", "experiment=", "ablation="))), None)
        if bad is not None:
            raise SpeceeError(f"experiment.{key} has {bad!r}; give key=value overrides of the jobs' settings "
                              "(their experiment= and ablation= are the preset's)")


def check_exit_control(cfg) -> None:
    """Exits decided on the device: the compiled runtime's static cache, autoregressive SpecEE."""
    from specee.decoding import modes
    r, a = cfg.runtime, cfg.ablation
    if r.exit_control == "host":
        return
    if r.exit_control == "device" and r.kind != "compiled":
        raise SpeceeError(f"runtime.exit_control=device runs on the compiled runtime's static KV cache; "
                          f"runtime={r.name} is {r.kind}: use runtime=compiled")
    spec = modes.of(a)
    if not (spec.needs_bank and spec.verified_exits):
        raise SpeceeError(f"runtime.exit_control={r.exit_control} decides SpecEE's verified exits; ablation={a.name} "
                          "has none (use runtime.exit_control=host)")
    if spec.is_tree(a):
        raise SpeceeError(f"runtime.exit_control={r.exit_control} is autoregressive SpecEE's walk; ablation={a.name} "
                          "decodes a tree, whose exits (hyper-tokens merged over paths) are decided on the host, "
                          "where a step's few round trips are shared by the tokens it accepts: use "
                          "runtime.exit_control=host")


def check_dataset(d) -> None:
    """A user's own prompt set names its file and the key holding its prompts."""
    if d.source in ("jsonl", "hf"):
        if not d.path:
            raise SpeceeError(f"dataset={d.name} needs dataset.path="
                              + ("FILE.jsonl" if d.source == "jsonl" else "DATASET_DIR (or a hub id with dataset.allow_hub=true)"))
        if not (d.field or d.turns_field):
            raise SpeceeError(f"dataset={d.name} needs dataset.field=KEY (the prompt text) "
                              "or dataset.turns_field=KEY (a list of user turns)")


def check_peer_settings(cfg) -> None:
    """ablation.num_tokens (1..64, or auto for pld and specee_pld), ablation.exit_layer (1..L-1 or
    auto) and speed-only settings, in one line each."""
    from specee.decoding import modes
    a = cfg.ablation
    spec = modes.of(a)
    if a.speculation not in spec.speculation_options or (a.speculation != "draft" and spec.is_tree(a)):
        raise SpeceeError(f"ablation.speculation={a.speculation} is autoregressive SpecEE's speculative set from the "
                          f"prompt; ablation={a.name} (mode {a.mode}, {a.decoding}) has none: use specee_pld")
    # hf_pld runs transformers' prompt lookup at a fixed length; pld and SpecEE's lookup choose theirs
    lookup_auto = spec.costs.block_cost or a.speculation == "prompt_lookup"
    n = a.num_tokens
    if n == "auto":
        if spec.speed_only:
            raise SpeceeError(f"ablation.num_tokens=auto is the harness's choice for its own pld; {a.mode} runs "
                              "transformers' prompt lookup at a fixed length: give ablation.num_tokens=N (1..64)")
    elif isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
        raise SpeceeError(f"ablation.num_tokens={n!r} must be a whole number in [1, 64]"
                          + (" or auto" if lookup_auto else ""))
    k = a.exit_layer
    if k != "auto":  # a wrong value is wrong whether or not this mode reads it
        L = cfg.model.num_layers  # known here for a random-init cut; else checked when the model loads
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (L is not None and k >= L):
            raise SpeceeError(check_exit_layer_text(k, L))
    if (spec.speed_only or a.speculation == "prompt_lookup") and not recipe(cfg).runs_speed_baselines:
        raise SpeceeError(f"ablation={a.name} is a speed baseline (transformers' generate, or speculation that "
                          f"only decoding uses): run it with experiment=speed, not experiment={recipe_name(cfg)}")


def check_exit_layer_text(k, L) -> str:
    return (f"ablation.exit_layer={k!r} must be auto or a layer count in [1, {L - 1}] (the draft is the "
            f"model's first k of its {L} layers)" if L else
            f"ablation.exit_layer={k!r} must be auto or a whole number of layers >= 1, below the model's layer count")


def check_tree(cfg) -> None:
    """The draft tree builds (in every mode: a tree given but unused is still a mistake worth
    naming), and, where the mode decodes it, its child ranks index the draft's top-K
    (early_exit.k): a rank >= K has no token there (torch's 'selected index k out of range'
    after the model has loaded)."""
    from specee.decoding import modes
    from specee.decoding.tree_shape import build
    a, k = cfg.ablation, cfg.early_exit.k
    tree = OmegaConf.to_container(a.tree) if OmegaConf.is_config(a.tree) else a.tree
    # ablation.tree defaults to the model's (${model.tree}): a bad one is named where it was set
    where = "ablation.tree"
    if OmegaConf.is_interpolation(a, "tree") and "model.tree" in str(a._get_node("tree")._value()):
        where = "model.tree (which ablation.tree follows)"
    try:
        paths = build(tree).paths
    except SpeceeError as err:
        raise SpeceeError(f"{where}: {err}") from None
    if not modes.is_tree(a):
        return
    top = max((r for p in paths for r in p), default=-1)
    if top >= k:
        raise SpeceeError(f"{where} has a node of rank {top}, beyond the draft's top-{k} "
                          f"(early_exit.k={k}); use ranks below {k} or raise early_exit.k to {top + 1}")


def check_target(cfg) -> None:
    import dataclasses
    schema = schema_of(cfg.experiment, None)
    if schema is None:
        raise SpeceeError("experiment= must name an experiment option; valid: " + ", ".join(options("experiment")))
    default = next((f.default for f in dataclasses.fields(schema) if f.name == "_target_"), None)
    if cfg.experiment.get("_target_") != default:
        raise SpeceeError(f"experiment._target_={cfg.experiment.get('_target_')!r} is set by the experiment option; "
                          "choose experiment=NAME instead (valid: " + ", ".join(options("experiment")) + ")")
