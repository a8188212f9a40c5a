"""The decoding modes, one spec each: the only place a mode's name is compared.

A mode is what ``ablation.mode`` names. Its spec says how its decoder is built from a config,
what it needs (a draft head, a predictor bank with its schedule, an AdaInfer classifier),
whether it decodes a tree, whether it is lossless, which extra metrics a speed result carries
for it, how the cost model counts its work and how the report labels it. Validation, preflight,
the launcher, the cost model, results and the report read these specs; none of them names a mode.

Adding a mode: its decoder module, its ``conf/ablation/<name>.yaml``, one :func:`register` call
(below, or in its own module imported from :func:`_builtin`), and its tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from specee.errors import SpeceeError

TREE_NEVER, TREE_ALWAYS, TREE_OPTION = "never", "always", "option"


@dataclass(frozen=True)
class CostCounts:
    """How the cost model reads a mode's step traces (specee/cost_model/priced_work.py)."""
    dense: bool = False  # every step: all layers, one LM head (no trace needed)
    lm_head_per_predictor_call: bool = False  # each predictor call is a full LM head (AdaInfer)
    draft_step_per_step: bool = False  # autoregressive: one draft proposal per step (draft_calls if traced)
    block_cost: bool = False  # each step is one verification block c(n) (prompt lookup)
    rule_probe: bool = False  # each predictor call is one exit-rule decision, priced as rule_probe


@dataclass(frozen=True)
class ModeSpec:
    name: str
    label: str  # what the mode is, in a few words (reports, error messages)
    # build(cfg, rt, parts, *, shadow, eos_id, tuning) -> decoder; ``tuning`` (specee/tuning/) chooses
    # the settings a config leaves at auto from measurements, handed in so this registry, which
    # config validation reads, imports nothing that reads config
    build: Callable[..., Any]
    tree: str = TREE_NEVER  # never | always | option (ablation.decoding=tree)
    needs_draft: bool = False  # the draft head (draft=eagle)
    needs_bank: bool = False  # predictors, their placement schedule and an optional replay
    needs_adainfer: bool = False  # the AdaInfer SVM
    exit_rule: Any = None  # the ExitRule class it decodes with (specee/exit_rules/), else None
    lossless: bool = True  # greedy tokens equal dense's by construction
    speed_only: bool = False  # a speed baseline only (transformers' own generate)
    early_exit: bool = False  # leaves the stack early: exits measured against the oracle
    verified_exits: bool = False  # an exit is confirmed by the LM head (refuted fires are counted)
    shadow: bool = False  # can record where the all-layers policy would have exited
    speculation_options: tuple[str, ...] = ("draft",)  # ablation.speculation values it takes
    peer: str | None = None  # the transformers decoder timed beside it (speed jobs)
    reference: bool = False  # the baseline every other mode is compared against (dense)
    costs: CostCounts = field(default_factory=CostCounts)
    extra_metrics: tuple[str, ...] = ()  # metric keys a speed result carries for this mode only
    synthetic: dict = field(default_factory=dict)  # model.init=random: what stands in for its parts

    def is_tree(self, ablation) -> bool:
        """Whether this ablation decodes a draft tree (verification of several tokens per step)."""
        if self.tree == TREE_OPTION:
            return _get(ablation, "decoding", "autoregressive") == "tree"
        return self.tree == TREE_ALWAYS


_REGISTRY: dict[str, ModeSpec] = {}


def register(spec: ModeSpec) -> ModeSpec:
    """Add a mode (or replace one of the same name, e.g. in a test)."""
    _builtin()  # so a built-in registered later cannot replace it
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    _builtin()
    return tuple(_REGISTRY)


def spec(name: str) -> ModeSpec:
    _builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise SpeceeError(f"ablation.mode={name!r} is unknown; valid: {', '.join(_REGISTRY)}") from None


def reference() -> ModeSpec:
    """The mode every other one is compared against (one spec says ``reference=True``)."""
    _builtin()
    return next(s for s in _REGISTRY.values() if s.reference)


def _get(node, key: str, default=None):
    """A key of a config node or of a results.json's plain dict."""
    try:
        value = node.get(key, default)
    except AttributeError:
        value = getattr(node, key, default)
    return default if value is None else value


def of(ablation) -> ModeSpec:
    """The spec of an ablation config (or of ``doc["config"]["ablation"]`` in a result)."""
    return spec(str(_get(ablation, "mode", "dense")))


def is_tree(ablation) -> bool:
    return of(ablation).is_tree(ablation)


# Recipes that study SpecEE's exits (statistics, exit profiling) run autoregressive SpecEE whatever
# ablation= says; this is the ablation they merge in.
SPECEE_AR = {"mode": "specee", "decoding": "autoregressive", "speculation": "draft"}


def as_specee_ar(cfg):
    """``cfg`` with its ablation set to autoregressive SpecEE (its early_exit settings kept)."""
    from omegaconf import OmegaConf
    return OmegaConf.merge(cfg, {"ablation": SPECEE_AR})


def is_specee_ar(ablation) -> bool:
    return all(_get(ablation, k) == v for k, v in SPECEE_AR.items())


def bank_label(ablation) -> str | None:
    """What a mode decides exits with, where it is not a predictor bank (None: a bank)."""
    s = of(ablation)
    if s.needs_bank:
        return None
    if s.needs_adainfer:
        return "AdaInfer CRF" if _get(ablation, "classifier", "svm") == "crf" else "AdaInfer SVM"
    return "– (draft only)" if s.needs_draft else "–"


# -- the built-in modes ----------------------------------------------------------------------------
def _build_dense(cfg, rt, parts, **_):
    from specee.decoding.dense import DenseDecoder
    return DenseDecoder(rt)


def _build_specee(cfg, rt, parts, *, shadow: bool = False, tuning=None, **_):
    a, ee = cfg.ablation, cfg.early_exit
    common = dict(k=ee.k, kv_policy=ee.kv_policy, replay=parts.replay, delta_from=ee.delta_from)
    if of(a).is_tree(a):
        return _build_tree(cfg, rt, parts, tuning=tuning, **common)
    from specee.decoding.specee_ar import PromptLookupSpecEEDecoder, SpecEEDecoder
    if a.speculation == "prompt_lookup":
        return PromptLookupSpecEEDecoder(rt, parts.draft, parts.bank, schedule=parts.schedule, shadow=shadow,
                                         ngram_size=a.ngram_size, **common)
    return SpecEEDecoder(rt, parts.draft, parts.bank, schedule=parts.schedule, shadow=shadow, **common)


def _build_eagle(cfg, rt, parts, *, tuning=None, **_):
    return _build_tree(cfg, rt, parts, tuning=tuning, k=cfg.early_exit.k, kv_policy=cfg.early_exit.kv_policy)


def _build_tree(cfg, rt, parts, *, tuning=None, **kwargs):
    from specee.decoding.tree import TreeDecoder
    a = cfg.ablation
    tree = a.tree if isinstance(a.tree, str) else [list(p) for p in a.tree]
    choice = None
    if a.tree_select == "auto":
        choice = tuning.auto_tree(cfg, rt, parts.draft)
        tree = choice["chosen"]["paths"]
    decoder = TreeDecoder(rt, parts.draft, tree, bank=parts.bank, schedule=parts.schedule, mapping=a.mapping,
                          exit_rule=a.tree_exit_rule, **kwargs)
    decoder.tree_choice = choice
    return decoder


def _build_pld(cfg, rt, parts, *, eos_id=None, tuning=None, **_):
    from specee.decoding.pld import PromptLookupDecoder
    a, choice = cfg.ablation, None
    if a.num_tokens == "auto":  # the proposal length with the most tokens per unit time here
        choice = tuning.auto_num_tokens(cfg, rt, eos_id)
    decoder = PromptLookupDecoder(rt, num_tokens=choice["chosen"] if choice else a.num_tokens,
                                  ngram_size=a.ngram_size, eos_id=eos_id)
    decoder.lookup_choice = choice
    return decoder


def _build_hf_peer(cfg, rt, parts, *, eos_id=None, tuning=None, **_):
    from specee.decoding.hf_peer import build_peer
    return build_peer(cfg, rt, cfg.ablation.mode, eos_id, tuning=tuning)


def _build_adainfer(cfg, rt, parts, **_):
    from specee.decoding.adainfer import AdaInferDecoder
    return AdaInferDecoder(rt, parts.svm, kv_policy=cfg.early_exit.kv_policy)


def _build_exit_rule(cfg, rt, parts, **_):
    from specee.decoding.exit_rule import ExitRuleDecoder
    value = cfg.ablation.get("exit_value")
    return ExitRuleDecoder(rt, parts.rule, parts.rule.default if value is None else float(value),
                           kv_policy=cfg.early_exit.kv_policy)


def exit_rule_spec(rule) -> ModeSpec:
    """The decoding mode of a registered exit rule (specee/exit_rules/): everything it declares."""
    return ModeSpec(rule.name, rule.label, _build_exit_rule, lossless=False, early_exit=True, exit_rule=rule,
                    costs=CostCounts(rule_probe=True), extra_metrics=_EXIT_METRICS + _ORACLE_METRICS,
                    synthetic={"exit_rule": f"fixed stand-in for what {rule.name} fits"} if rule.fitted_on else {})


_EXIT_METRICS = ("predictor_calls_per_token", "verify_calls_per_token", "syncs_per_token", "exit_rate",
                 "fire_precision", "overhead_share", "draft_share", "time_split_s", "time_split_method",
                 "time_split_coverage", "efficiency")
_ORACLE_METRICS = ("oracle_gap", "avg_layers_over_oracle", "oracle_avg_layers", "tokens_not_full_stack_prediction",
                   "refuted_fires_per_token")
_RANDOM_DRAFT = {"draft": "random weights of the draft head's shape"}
_PEER_METRICS = ("peer",)  # transformers' peer timed in the same job
_HF_METRICS = _PEER_METRICS + ("speedup_vs_hf_plain", "speedup_vs_hf_plain_ci", "transformers_peer", "not_applicable")

_BUILTIN_DONE = False


def _builtin() -> None:
    global _BUILTIN_DONE
    if _BUILTIN_DONE:
        return
    _BUILTIN_DONE = True
    for s in (
        ModeSpec("dense", "dense (every layer, one token per step)", _build_dense, reference=True,
                 costs=CostCounts(dense=True)),
        ModeSpec("specee", "SpecEE (draft, predictors, LM-head verification)", _build_specee, tree=TREE_OPTION,
                 needs_draft=True, needs_bank=True, lossless=False, early_exit=True, verified_exits=True,
                 shadow=True, speculation_options=("draft", "prompt_lookup"),
                 costs=CostCounts(draft_step_per_step=True), extra_metrics=_EXIT_METRICS + _ORACLE_METRICS,
                 synthetic={**_RANDOM_DRAFT, "predictors": "random weights of the predictors' shape"}),
        ModeSpec("adainfer", "AdaInfer (SVM or CRF over layers, on gap and top probability)", _build_adainfer,
                 needs_adainfer=True, lossless=False, early_exit=True,
                 costs=CostCounts(lm_head_per_predictor_call=True), extra_metrics=_EXIT_METRICS + _ORACLE_METRICS,
                 synthetic={"adainfer_classifier": "fixed stand-in coefficients"}),
        ModeSpec("eagle", "EAGLE tree speculative decoding", _build_eagle, tree=TREE_ALWAYS, needs_draft=True,
                 extra_metrics=_EXIT_METRICS, synthetic=dict(_RANDOM_DRAFT)),
        ModeSpec("pld", "prompt lookup decoding (the harness's)", _build_pld, peer="hf_pld",
                 costs=CostCounts(block_cost=True),
                 extra_metrics=_PEER_METRICS + ("speedup_vs_hf_pld", "speedup_vs_hf_pld_ci", "prompt_lookup")),
        ModeSpec("hf_pld", "transformers' prompt lookup (generate)", _build_hf_peer, speed_only=True,
                 peer="hf_plain", extra_metrics=_HF_METRICS),
        ModeSpec("hf_self_spec", "transformers' early-exit self-speculation (generate)", _build_hf_peer,
                 speed_only=True, peer="hf_plain", extra_metrics=_HF_METRICS),
    ):
        register(s)
    from specee.exit_rules import registered  # imports nothing from decoding: no loop
    for rule in registered().values():
        register(exit_rule_spec(rule))
