"""Atomic writes, the one JSON reader and project-relative paths: a killed job never leaves a
half-written result, and every JSON file the harness reads (cards, profiles, results) is read alike."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from specee.errors import SpeceeError

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def project_path(path: str | os.PathLike) -> Path:
    """Relative paths in configs are relative to the project root, not to the shell's cwd."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else (PROJECT_ROOT / p).resolve()


def read_json(path: str | Path, fix: str) -> Any:
    """The parsed document at ``path``; ``fix`` says what to do when it is unusable."""
    path = Path(path)
    if not path.is_file():
        raise SpeceeError(f"missing {path}; {fix}")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is UTF-8 too (editors write it)
    except (OSError, UnicodeDecodeError) as err:
        raise SpeceeError(f"{path} is corrupt (unreadable: {type(err).__name__}); {fix}") from None
    if not text.strip():
        raise SpeceeError(f"{path} is corrupt (empty file); {fix}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        # An error at the very end of the text is a file cut short (a killed write, a partial copy).
        cut = " (truncated)" if err.pos >= len(text.rstrip()) else ""
        raise SpeceeError(f"{path} is corrupt{cut}: not valid JSON ({err.msg}, line {err.lineno}); {fix}") from None


def write_json_atomic(path: str | os.PathLike, obj) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        _storage_failed(path, obj, err)
        raise
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; results are meant to be shared
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            _storage_failed(path, obj, err)
        raise
    return path


# Errors of the storage, not of the program: a full disk or quota, a read-only or vanished folder.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
                  errno.ENOTDIR, errno.EIO}


def _storage_failed(path: Path, obj, err: OSError) -> None:
    """The final write of a long job failed (the disk filled while it ran): say so in one line and
    print what it measured, so the hours of work are not lost with the file. Other errors are bugs."""
    if err.errno not in STORAGE_ERRNOS:
        return
    import sys
    metrics = obj.get("metrics") if isinstance(obj, dict) else None
    if metrics is not None:
        # The terminal, not the run's log: the log is on the disk that just failed.
        out = sys.__stdout__ or sys.stdout
        print(f"specee: {path.name} could not be written; its metrics summary follows:", file=out)
        print(json.dumps(metrics, indent=1, default=str), file=out, flush=True)
    kept = "; the metrics summary is printed above" if metrics is not None else ""
    raise SpeceeError(f"could not write {path} ({err.strerror or type(err).__name__}){kept}; free space on "
                      f"that disk (or choose another output folder) and run the job again") from None


MIN_FREE_MB = 8  # a run's config, log and results.json; SPECEE_MIN_FREE_MB sets another floor


def min_free_bytes() -> int:
    raw = os.environ.get("SPECEE_MIN_FREE_MB")
    try:
        return int(float(raw) * 2**20) if raw else MIN_FREE_MB * 2**20
    except ValueError:
        raise SpeceeError(f"SPECEE_MIN_FREE_MB={raw!r} is not a number of megabytes") from None


def check_output_dir(folder: str | os.PathLike, key: str = "hydra.run.dir") -> None:
    """Where results go is checked before any work: ``folder`` can be made (no file in the way),
    written (a real write, not a permission bit: a read-only or full disk fails it) and has room.
    Nothing is created but a probe file, removed at once. Raises SpeceeError naming the folder."""
    folder = Path(folder).expanduser()
    at = folder.absolute()
    while not at.exists() and at != at.parent:
        at = at.parent
    if not at.is_dir():
        raise SpeceeError(f"{key}={folder} cannot be created: {at} is a file, not a folder; choose another "
                          f"{key} (or move that file)")
    try:
        fd, probe = tempfile.mkstemp(dir=at, prefix=".specee-write-probe.")
        try:
            os.write(fd, b"\0" * 65536)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as err:
        raise SpeceeError(f"{key}={folder} cannot be written: writing in {at} failed ({err.strerror or err}); "
                          f"free space or fix permissions there, or choose another {key}") from None
    free, need = shutil.disk_usage(at).free, min_free_bytes()
    if free < need:
        raise SpeceeError(f"{key}={folder}: only {free / 2**20:.1f} MB free on the disk that holds {at} (a run "
                          f"needs {need / 2**20:.0f} MB for its config, log and results); free space there or "
                          f"choose another {key}")


def check_output_of_command(argv) -> None:
    """The folder a command line will write (its hydra.run.dir, or hydra.sweep.dir under -m; the
    config's default when not given), checked before Hydra makes it."""
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser
    key = "hydra.sweep.dir" if any(a in ("-m", "--multirun") for a in argv) else "hydra.run.dir"
    value = None
    try:
        for o in OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")]):
            if o.key_or_group == key and not o.is_sweep_override():
                value = o.value()
    except Exception:  # noqa: BLE001 - the command line was parsed and checked already
        return
    if not isinstance(value, str) or not value:
        default = yaml.safe_load((PROJECT_ROOT / "conf" / "config.yaml").read_text())["hydra"]
        value = str(default["sweep" if key == "hydra.sweep.dir" else "run"]["dir"])
    # Interpolations (a date, the model's name) resolve only in Hydra; the folders before them are
    # where the run goes (a value that starts with one is left to the run's own check).
    static = value.split("${", 1)[0]
    if static == value:
        check_output_dir(value, key)
    elif static:
        check_output_dir(static if static.endswith("/") else Path(static).parent, key)


class RunLog:
    """run.log, written beside the terminal: when its disk fills, the log stops (once, said on the
    terminal) and the job's output still reaches the terminal instead of ending in a traceback."""

    def __init__(self, path: Path):
        self._f = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - lives for the process
        self._path, self._broken = path, False

    def write(self, text: str) -> int:
        if not self._broken:
            try:
                self._f.write(text)
            except OSError as err:
                self._stop(err)
        return len(text)

    def flush(self) -> None:
        if not self._broken:
            try:
                self._f.flush()
            except OSError as err:
                self._stop(err)

    def _stop(self, err: OSError) -> None:
        import sys
        self._broken = True
        with contextlib.suppress(OSError, ValueError):
            self._f.close()
        print(f"specee: {self._path} stopped ({err.strerror or err}); output continues here only",
              file=sys.__stderr__ or sys.stderr)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike):
    """Hold an exclusive advisory lock on ``path`` (created if missing) for the block: processes that
    write the same folder take turns instead of interleaving."""
    import fcntl
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike):
    """Yield a temp dir beside ``final``; on success it replaces ``final`` in one rename."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    tmp.chmod(0o755)  # mkdtemp is private by default; artifacts are meant to be shared
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
