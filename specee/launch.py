"""Dispatch a composed config to its experiment recipe."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf

from specee.config import check_choices, recipe, validate
from specee.data import data_root
from specee.io import project_path
from specee.results import RESULTS, finished, output_dir
from specee.errors import SpeceeError


class _Tee:
    """Write a stream's output to the terminal and to the job's run.log (a failed sweep job
    must leave a record of why)."""

    def __init__(self, stream, log):
        self._stream, self._log = stream, log

    def write(self, text):
        self._log.write(text)
        self._log.flush()
        return self._stream.write(text)

    def flush(self):
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def tee_output_to_run_log() -> None:
    import sys
    from hydra.core.hydra_config import HydraConfig
    try:
        out = Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # not under hydra.main (a library call)
        return
    out.mkdir(parents=True, exist_ok=True)
    from specee.io import RunLog
    try:
        log = RunLog(out / "run.log")  # stops, said once, when its disk fills: the terminal keeps the output
    except OSError as err:  # a full or read-only disk: claim_run_dir refuses the folder in one line
        print(f"specee: no run.log in {out} ({err.strerror or err})", file=sys.stderr)
        return
    sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)


_LOCK = None  # held for the life of the process


def claim_run_dir(cfg) -> None:
    """One process per run folder: refuse a folder in use by another specee process, or holding
    another finished run (force=true replaces it)."""
    global _LOCK
    import fcntl
    from hydra.core.hydra_config import HydraConfig
    try:
        out = Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return
    from specee.io import check_output_dir
    check_output_dir(out)  # writable with room, before any work (the disk may have filled since the command line)
    out.mkdir(parents=True, exist_ok=True)
    lock = open(out / ".specee.lock", "a+")  # noqa: SIM115 - held until exit
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SpeceeError(f"run folder {out} is in use by another specee process; wait for it or choose "
                          "another hydra.run.dir") from None
    _LOCK = lock
    # A recipe that reuses a finished run (skip-if-done, for sweeps) says so in its facts; every other
    # recipe refuses a folder that already holds a result unless force=true.
    if (out / "results.json").is_file() and not cfg.force and not recipe(cfg).reuses_finished:
        raise SpeceeError(f"run folder {out} already holds a finished run (results.json); choose another "
                          "hydra.run.dir or pass force=true to replace it")


def run_experiment(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig
    try:
        check_choices(HydraConfig.get().runtime.choices)
    except ValueError:  # not under hydra.main (a library call)
        pass
    check_config(cfg)
    claim_run_dir(cfg)
    data_root(project_path(cfg.paths.data_root))  # every recipe reads it: fail before any work
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target = cfg.experiment._target_
    try:
        fn = get_method(target)
    except Exception as err:  # noqa: BLE001 - hydra wraps import errors in its own type
        raise SpeceeError(f"experiment._target_={target!r} cannot be imported: {err}") from err
    if (done := reused_result(cfg)) is not None:
        hook = getattr(sys.modules[fn.__module__], "on_reuse", None)  # what a recipe still owes a reused run
        return hook(cfg, done) if hook is not None else done["metrics"]
    return fn(cfg)


def reused_result(cfg) -> dict | None:
    """Skip-if-done, in one place: a recipe whose facts say it reuses a finished run (sweeps rerun
    only what is missing) gets the finished result in its folder back, unless force=true; a recipe
    module may define ``on_reuse(cfg, doc)`` for what a reused run still does (a report, a drift check)."""
    if cfg.force or not recipe(cfg).reuses_finished:
        return None
    try:
        out = output_dir()
    except ValueError:  # not under hydra.main (a library call): nothing to reuse
        return None
    done = finished(out)
    if done is not None:
        print(f"results exist, skipping (force=true reruns): {out / RESULTS}")
    return done


# -- one checked path from the command line to a run ---------------------------------------------
def check_config(cfg) -> None:
    """A composed config: every value's type (instantiating the dataclasses), every field's range,
    the rules across groups, then every input file the run will read. Raises SpeceeError."""
    from omegaconf.errors import OmegaConfBaseException
    try:
        OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise SpeceeError(explain(err)) from None
    validate(cfg)
    from specee.preflight import preflight
    preflight(cfg)


def _chosen(group: str, overrides) -> str | None:
    """The option of ``group`` these overrides select (else conf/config.yaml's default)."""
    import yaml
    from specee.io import PROJECT_ROOT
    for o in reversed(list(overrides)):
        key, _, value = o.lstrip("+~").partition("=")
        if key.lstrip("/") == group and value:
            return value
    for entry in yaml.safe_load((PROJECT_ROOT / "conf" / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict) and group in entry:
            return entry[group]
    return None


def _schema_at(path: list[str], overrides):
    """The schema class of the node at ``path`` (e.g. ['experiment', 'calibration']), or None."""
    import dataclasses
    import typing
    from specee.config import Config, option_schema
    cls = Config
    for i, part in enumerate(path):
        hints = typing.get_type_hints(cls) if cls else {}
        if part not in hints:
            return None
        if i == 0 and not dataclasses.is_dataclass(hints[part]):
            option = _chosen(part, overrides)
            cls = option_schema(part, option) if option else None
        else:
            cls = hints[part] if dataclasses.is_dataclass(hints[part]) else None
    return cls


def _key_help(key: str, overrides) -> str:
    import dataclasses
    parent = key.split(".")[:-1]
    cls = _schema_at(parent, overrides)
    if cls is None:
        return "check the spelling (`python run.py --cfg job` prints every key)"
    names = [f.name for f in dataclasses.fields(cls)]
    return f"valid keys{' of ' + '.'.join(parent) if parent else ''}: {', '.join(names)}"


def explain(err, overrides=()) -> str:
    """One line naming the key or option and the fix, for an error Hydra or OmegaConf raised
    while composing (the same inputs would otherwise end in their multi-line reports)."""
    import re
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException
    from specee.config import options
    from specee.errors import one_line
    text = str(err)
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    if isinstance(err, MissingConfigException):
        m = re.search(r"Could not find '/?([\w/]+)/([^'/]+)'", text)
        if m and (err.options is not None or m.group(1) in ("model", "ablation", "dataset", "draft",
                                                              "placement", "runtime", "experiment")):
            return (f"{m.group(1)}={m.group(2)} is not an option; valid: {', '.join(options(m.group(1)))}")
        return one_line(first)
    if isinstance(err, OverrideParseException):
        return f"cannot parse the command line: {one_line(first)}; write key=value (quote values with spaces)"
    cause = err.__cause__ or err.__context__
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        return f"{m.group(1)} is not a setting; {_key_help(m.group(1), overrides)}"
    m = re.search(r"Could not append to config. An item is already at '([^']+)'", text)
    if m:
        return f"{m.group(1)} already exists: set it without '+' ({m.group(1)}=VALUE)"
    m = re.search(r"Error merging override (\S+)", text)
    if m and m.group(1).startswith("~"):
        return (f"{m.group(1)}: a declared setting cannot be removed; set {m.group(1)[1:].split('=')[0]}=null "
                "where the schema allows it")
    if m and isinstance(cause, OmegaConfBaseException):
        key = cause.full_key or m.group(1).lstrip("+~").split("=")[0]
        why = (cause.msg or str(cause)).strip().splitlines()[0]
        return f"{m.group(1)}: {why} (the value does not fit {key}'s declared type; see conf/ or specee/config/schemas.py)"
    if isinstance(err, OmegaConfBaseException):
        key = err.full_key or "the config"
        return f"{key}: {one_line((err.msg or first).strip().splitlines()[0])}"
    extra = f" ({one_line(str(cause).strip().splitlines()[0])})" if cause is not None and str(cause).strip() else ""
    return one_line(first) + extra


def compose_and_check(overrides) -> DictConfig:
    """Compose the command line's overrides as run.py would and check the result: the config
    and every input file, in this process, before Hydra creates a run folder or anything loads."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict
    from specee.config import register
    from specee.io import PROJECT_ROOT
    register()
    try:
        with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", list(overrides), return_hydra_config=True)
    except SpeceeError:
        raise
    except Exception as err:  # noqa: BLE001 - Hydra and OmegaConf raise many types for bad input
        raise SpeceeError(explain(err, overrides)) from None
    check_choices(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    check_config(cfg)
    return cfg


def sweep_jobs(argv) -> list[list[str]] | None:
    """For a sweep (-m): each value of each swept key once, beside the first of the others (a
    bad value anywhere is found before the first job runs, without composing the whole product);
    None when a sweep needs Hydra's config loader to expand (glob)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides([a for a in argv if not a.startswith("-")])
    except Exception as err:  # noqa: BLE001 - Hydra's parse errors
        raise SpeceeError(explain(err, argv)) from None
    fixed, swept = [], []
    for o in parsed:
        if not o.is_sweep_override():
            fixed.append(o.input_line)
            continue
        try:
            values = list(o.sweep_string_iterator())
        except Exception:  # noqa: BLE001 - glob() needs the loader; the jobs check themselves
            return None
        swept.append([f"{o.get_key_element()}={v}" for v in values] or [o.input_line])
    try:  # a value that does not read back as written (quoting) is left to the jobs' own checks
        parser.parse_overrides([v for vals in swept for v in vals])
    except Exception:  # noqa: BLE001
        return None
    first = [vals[0] for vals in swept]
    jobs = [fixed + first]
    for i, vals in enumerate(swept):
        jobs += [fixed + first[:i] + [v] + first[i + 1:] for v in vals[1:]]
    return jobs


def check_command_line(argv) -> None:
    """run.py's first step: a bad command line or input file is one `specee: error:` line and
    exit status 2, before Hydra makes a run folder. A sweep's values are checked the same way
    (see sweep_jobs); other flags (--cfg, --help, ...) are left to Hydra."""
    import sys
    from specee.errors import one_line
    flags = [a for a in argv if a.startswith("-")]
    try:
        if not flags:
            compose_and_check(argv)
        elif set(flags) <= {"-m", "--multirun"}:
            for job in sweep_jobs(argv) or []:
                try:
                    compose_and_check(job)
                except SpeceeError as err:
                    raise SpeceeError(f"sweep job [{' '.join(job)}]: {err}") from None
        if set(flags) <= {"-m", "--multirun"}:  # where results go, before Hydra makes the folder
            from specee.io import check_output_of_command
            check_output_of_command(argv)
    except SpeceeError as err:
        print(f"specee: error: {one_line(err)}", file=sys.stderr)
        sys.exit(2)
