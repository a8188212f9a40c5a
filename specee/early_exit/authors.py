"""The SpecEE authors' released predictor bank (Llama-2-7b-chat, Apache-2.0), read without running it.

Their ``model{i}.pth`` files are whole pickled modules (``torch.save(module)`` of a class ``MLP``
defined in their ``__main__``): ``fc1 = Linear(12, 512)``, ``relu``, ``fc2 = Linear(512, 1)``,
``sigmoid``. ``torch.load(weights_only=False)`` would execute whatever the pickle names, so
:func:`read_authors_mlp` unpickles with a reader that knows only that layout: the four module
classes become inert records, tensors are rebuilt from the archive's raw storages by this module's
own code, and any other global is refused before anything in the pickle is called.

Their feature (``authors_feature``) and scheduling constants are written down here, so tests can
hold the harness's definition (specee/early_exit/features.py) against it.
"""
from __future__ import annotations

import pickle
import re
import zipfile
from collections import OrderedDict
from pathlib import Path

import torch

from specee.data import sha256 as sha256_file  # one file hash (specee/data.py)
from specee.errors import SpeceeError

# Their 32-layer Llama-2-7B layout: K = 4 speculative tokens, 3K = 12 features, 512 hidden units.
AUTHORS_K = 4
AUTHORS_HIDDEN = 512
AUTHORS_LAYERS = 32
# Their offline scheduled set for Llama-2-7B (0-based decoder layers), and the online rule: the exit
# layers x (1-based) of the last 5 tokens add layers {x-2, x, x+2} - 1, kept within 0..30.
AUTHORS_OFFLINE_7B = (15, 16, 17, 19, 21, 24, 26, 28)
AUTHORS_ONLINE_OFFSETS = (-2, 0, 2)
AUTHORS_ONLINE_HISTORY = 5
AUTHORS_FEATURE_DEFINITION = (
    "concat(z, softmax(z), softmax(z) - p_prev) with z = norm(h_l) @ lm_head.weight[S].T, S = draft top-K in "
    "rank order, p_prev = softmax(z) at the previous *scheduled* layer of this token, and no subtraction "
    "(p_prev = 0) at the token's first scheduled layer (training collection: every layer scheduled, "
    "so p_prev = layer l-1, and 0 at layer 0)")
SOURCE_NAME = "the SpecEE authors' predictor bank for Llama-2-7b-chat"
LICENCE = "Apache-2.0"
_FILE = re.compile(r"model(\d+)\.pth")
_KNOWN_MODULES = ("MLP", "Linear", "ReLU", "Sigmoid")
_STORAGE_DTYPES = {"FloatStorage": torch.float32, "HalfStorage": torch.float16,
                   "BFloat16Storage": torch.bfloat16, "DoubleStorage": torch.float64}


class _Refused(Exception):
    """Raised inside the unpickler; turned into one SpeceeError line naming the file."""


class _Record:
    """An inert stand-in for one of the authors' module classes: it keeps the pickled state and
    has no behaviour, so building it runs nothing of theirs (or torch.nn's)."""

    kind = "?"

    def __new__(cls, *args):
        if args:
            raise _Refused(f"{cls.kind} built with arguments {args!r:.60}")
        return object.__new__(cls)

    def __init__(self, *args):  # REDUCE on the class lands here: no arguments allowed (see __new__)
        pass

    def __setstate__(self, state):
        if not isinstance(state, dict):
            raise _Refused(f"{self.kind} state is a {type(state).__name__}, not a dict")
        self.state = state


_RECORDS = {name: type(f"_{name}Record", (_Record,), {"kind": name}) for name in _KNOWN_MODULES}


class _StorageType:
    def __init__(self, name: str):
        self.name, self.dtype = name, _STORAGE_DTYPES[name]


def _rebuild_tensor(storage, offset, size, stride, requires_grad, backward_hooks, metadata=None):
    """torch._utils._rebuild_tensor_v2, written out: a strided view of the storage, bounds-checked,
    copied into a fresh CPU tensor."""
    if not isinstance(storage, torch.Tensor):
        raise _Refused("a tensor's storage is not one of the archive's storages")
    ints = lambda t: isinstance(t, tuple) and all(isinstance(v, int) and v >= 0 for v in t)  # noqa: E731
    if not (isinstance(offset, int) and offset >= 0 and ints(size) and ints(stride) and len(size) == len(stride)):
        raise _Refused(f"a tensor has a malformed layout (offset {offset!r}, size {size!r}, stride {stride!r})")
    if backward_hooks or metadata:
        raise _Refused("a tensor carries hooks or metadata")
    if all(size):
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= storage.numel():
            raise _Refused(f"a tensor of size {size} reaches past its storage ({storage.numel()} values)")
    return torch.as_strided(storage, size, stride, offset).clone()


def _rebuild_parameter(data, requires_grad, backward_hooks):
    if not isinstance(data, torch.Tensor) or backward_hooks:
        raise _Refused("a parameter is not a plain tensor")
    return data


# The only globals the authors' files name (torch.save of their MLP under torch 2.x, protocol 2).
_ALLOWED = {
    ("__main__", "MLP"): _RECORDS["MLP"],
    ("torch.nn.modules.linear", "Linear"): _RECORDS["Linear"],
    ("torch.nn.modules.activation", "ReLU"): _RECORDS["ReLU"],
    ("torch.nn.modules.activation", "Sigmoid"): _RECORDS["Sigmoid"],
    ("collections", "OrderedDict"): OrderedDict,
    ("__builtin__", "set"): set,
    ("builtins", "set"): set,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **{("torch", name): _StorageType(name) for name in _STORAGE_DTYPES},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str):
        import io
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.storages = archive, prefix, {}

    def find_class(self, module, name):
        # Every global a pickle can reach (GLOBAL, STACK_GLOBAL, INST, OBJ, EXT*) passes here: an
        # unknown one stops the load before any REDUCE could call it.
        found = _ALLOWED.get((module, name))
        if found is None:
            raise _Refused(f"its pickle names the global {module}.{name}, which this reader does not know (it "
                           "rebuilds only the authors' __main__.MLP of Linear/ReLU/Sigmoid and tensors); nothing "
                           "in the file was run")
        return found  # a _StorageType is inert: persistent_load only reads its dtype

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and pid[2].isdigit()
                and isinstance(pid[4], int)):
            raise _Refused(f"unexpected persistent id {pid!r:.80}")
        kind, key, numel = pid[1], pid[2], pid[4]
        if key not in self.storages:
            try:
                raw = self.archive.read(f"{self.prefix}/data/{key}")
            except KeyError:
                raise _Refused(f"storage {key} is missing from the archive") from None
            itemsize = torch.empty(0, dtype=kind.dtype).element_size()
            if len(raw) != numel * itemsize:
                raise _Refused(f"storage {key} holds {len(raw)} bytes, not {numel} x {itemsize}")
            self.storages[key] = torch.frombuffer(bytearray(raw), dtype=kind.dtype) if raw else \
                torch.empty(0, dtype=kind.dtype)
        return self.storages[key]


def _unpickle(path: Path):
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise SpeceeError(f"{path} is not a torch zip archive ({err}); the authors' files are torch.save "
                          "zip archives") from None
    with archive:
        pkls = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise SpeceeError(f"{path} is not a torch.save archive (it holds {len(pkls)} <name>/data.pkl entries)")
        prefix = pkls[0].split("/")[0]
        order = f"{prefix}/byteorder"
        if order in archive.namelist() and archive.read(order).strip() != b"little":
            raise SpeceeError(f"{path} was written big-endian; only little-endian archives are read")
        try:
            return _Unpickler(archive.read(pkls[0]), archive, prefix).load()
        except _Refused as err:
            raise SpeceeError(f"{path} refused: {err}") from None
        except Exception as err:  # noqa: BLE001 - a malformed pickle: one line, whatever the opcode
            raise SpeceeError(f"{path} is not a readable pickle of the authors' MLP "
                              f"({type(err).__name__}: {str(err)[:120]})") from None


def _child(state: dict, name: str, kind: str, path: Path):
    mods = state.get("_modules")
    rec = mods.get(name) if isinstance(mods, dict) else None
    if not isinstance(rec, _RECORDS[kind]) or not isinstance(getattr(rec, "state", None), dict):
        raise SpeceeError(f"{path}: the MLP's {name!r} is not a {kind} (the authors' layout is fc1 Linear, relu, "
                          "fc2 Linear, sigmoid)")
    return rec.state


def _params(state: dict, name: str, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    params = state.get("_parameters")
    if not isinstance(params, dict) or set(params) != {"weight", "bias"} or not all(
            isinstance(v, torch.Tensor) for v in params.values()):
        raise SpeceeError(f"{path}: {name} does not hold exactly a weight and a bias tensor")
    return params["weight"], params["bias"]


def read_authors_mlp(path: str | Path, k: int = AUTHORS_K) -> dict[str, torch.Tensor]:
    """One ``model{i}.pth`` as float32 tensors fc1_weight (H, 3K), fc1_bias (H,), fc2_weight (1, H),
    fc2_bias (1,), without executing the pickle; anything else is one SpeceeError line."""
    path = Path(path)
    obj = _unpickle(path)
    if not isinstance(obj, _RECORDS["MLP"]) or not isinstance(getattr(obj, "state", None), dict):
        raise SpeceeError(f"{path} does not hold the authors' MLP module (it holds a {type(obj).__name__})")
    mods = obj.state.get("_modules")
    if not isinstance(mods, dict) or list(mods) != ["fc1", "relu", "fc2", "sigmoid"]:
        got = list(mods) if isinstance(mods, dict) else type(mods).__name__
        raise SpeceeError(f"{path}: the MLP's submodules are {got}, not the authors' [fc1, relu, fc2, sigmoid]")
    _child(obj.state, "relu", "ReLU", path)
    _child(obj.state, "sigmoid", "Sigmoid", path)
    w1, b1 = _params(_child(obj.state, "fc1", "Linear", path), "fc1", path)
    w2, b2 = _params(_child(obj.state, "fc2", "Linear", path), "fc2", path)
    hidden, n_in = (w1.shape[0], w1.shape[1]) if w1.dim() == 2 else (-1, -1)
    if n_in - 2 * k >= 64:  # d + 2K inputs, d a model's hidden size: their layout for other depths
        raise SpeceeError(f"{path}: fc1 takes {n_in} inputs, not 3K = {3 * k}: the authors' other feature layout "
                          f"(cat(norm(h), draft logits, draft probs) = d + 2K with d = {n_in - 2 * k}, for their "
                          f"models that are not {AUTHORS_LAYERS} layers deep) is not supported; the harness computes "
                          "only the 3K-value features")
    want = {"fc1.weight": (w1, (hidden, 3 * k)), "fc1.bias": (b1, (hidden,)), "fc2.weight": (w2, (1, hidden)),
            "fc2.bias": (b2, (1,))}
    wrong = {n: tuple(t.shape) for n, (t, s) in want.items() if tuple(t.shape) != s or hidden < 1}
    if wrong:
        raise SpeceeError(f"{path}: shapes {wrong} are not an MLP 3K={3 * k} -> H -> 1 (fc1 {tuple(w1.shape)}); "
                          "not the authors' predictor layout")
    out = {"fc1_weight": w1, "fc1_bias": b1, "fc2_weight": w2, "fc2_bias": b2}
    for name, t in out.items():
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise SpeceeError(f"{path}: {name.replace('_', '.')} holds non-finite values (NaN or inf); "
                              "the file is corrupt")
    return {n: t.float().contiguous() for n, t in out.items()}


def authors_files(folder: str | Path) -> list[Path]:
    """model0.pth .. model{L-1}.pth of ``folder``, checked to be one unbroken run from 0."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SpeceeError(f"no authors' predictor folder at {folder}; point experiment.source at the folder "
                          "holding their model0.pth .. model31.pth")
    found = {int(m.group(1)): p for p in folder.iterdir() if (m := _FILE.fullmatch(p.name))}
    if not found:
        raise SpeceeError(f"{folder} holds no model<i>.pth files (the authors' per-layer predictors)")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise SpeceeError(f"{folder} lacks model{missing[0]}.pth ({len(missing)} of model0..model{max(found)} "
                          "missing); copy the authors' folder again")
    return [found[i] for i in range(len(found))]


def load_authors_bank(folder: str | Path, num_layers: int | None = None, k: int = AUTHORS_K,
                      threshold: float = 0.5):
    """(PredictorBank, {file name: sha256}) from the authors' folder. Their 12-feature layout is the
    one their code uses for 32-layer models; any other depth (or a model of another depth) is refused."""
    from specee.early_exit.predictor import PredictorBank
    files = authors_files(folder)
    if len(files) != AUTHORS_LAYERS:
        raise SpeceeError(f"{folder} holds {len(files)} predictors; the authors' 3K-feature layout is their "
                          f"{AUTHORS_LAYERS}-layer one (for other depths their code feeds cat(norm(h), logits, "
                          "probs), which the harness does not compute)")
    if num_layers is not None and num_layers != len(files):
        raise SpeceeError(f"the authors' bank at {folder} has {len(files)} layers; this model has {num_layers}")
    mlps = [read_authors_mlp(p, k) for p in files]
    hidden = {m["fc1_weight"].shape[0] for m in mlps}
    if len(hidden) != 1:
        raise SpeceeError(f"{folder}: the layers' hidden sizes differ ({sorted(hidden)}); one bank needs one size")
    bank = PredictorBank(len(files), k, hidden.pop(), threshold)
    with torch.no_grad():
        for i, m in enumerate(mlps):
            bank.w1[i] = m["fc1_weight"].T
            bank.b1[i] = m["fc1_bias"]
            bank.w2[i] = m["fc2_weight"][0]
            bank.b2[i] = m["fc2_bias"][0]
            bank.has[i] = True
    return bank, {p.name: sha256_file(p) for p in files}


def authors_mlp_prob(m: dict[str, torch.Tensor], feats: torch.Tensor) -> torch.Tensor:
    """Their MLP.forward, written out: sigmoid(fc2(relu(fc1(x))))."""
    h = torch.relu(feats @ m["fc1_weight"].T + m["fc1_bias"])
    return torch.sigmoid(h @ m["fc2_weight"].T + m["fc2_bias"]).squeeze(-1)


# -- their feature -------------------------------------------------------------------------------
def authors_feature(normed_h: torch.Tensor, spec_weight: torch.Tensor, last_prob: torch.Tensor | None):
    """(feature (3K,), draft_prob) at one scheduled layer, as their decoder computes it:
    draft_logits = norm(h) @ lm_head.weight[S].T, draft_prob = softmax(draft_logits), and
    prob_gap = draft_prob - last_prob, or draft_prob itself at the token's first scheduled layer
    (``last_prob=None``); feature = cat([draft_logits, draft_prob, prob_gap])."""
    logits = (spec_weight @ normed_h).float()
    prob = torch.softmax(logits, -1)
    gap = prob if last_prob is None else prob - last_prob
    return torch.cat([logits, prob, gap]), prob


def authors_token_features(normed: dict[int, torch.Tensor], scheduled, spec_weight: torch.Tensor):
    """{layer: feature} for one token over its scheduled layers (ascending), ``normed[l]`` being
    norm(h_l); last_prob carries from one scheduled layer to the next."""
    out, last = {}, None
    for layer in sorted(scheduled):
        out[layer], last = authors_feature(normed[layer], spec_weight, last)
    return out


def authors_schedule(exit_history: list[int], num_layers: int = AUTHORS_LAYERS) -> list[int]:
    """Their scheduled set for the next token, from the 1-based exit layers recorded so far (a
    token without an exit records ``num_layers``): the offline set, plus, once five exits are
    recorded, {x-2, x, x+2} - 1 for the last five, within 0..num_layers-2."""
    layers = set(AUTHORS_OFFLINE_7B)
    if len(exit_history) >= AUTHORS_ONLINE_HISTORY:
        for x in exit_history[-AUTHORS_ONLINE_HISTORY:]:
            layers |= {x + d - 1 for d in AUTHORS_ONLINE_OFFSETS if 0 <= x + d - 1 < num_layers - 1}
    return sorted(layers)


def card_for(source: Path, sha: dict[str, str], extra_files: dict[str, str], bank, model: str) -> dict:
    """The harness bank card of an imported authors' bank."""
    return {
        "model": model,
        "num_layers": bank.num_layers,
        "k": bank.k,
        "hidden": int(bank.w1.shape[-1]),
        "threshold": 0.5,
        "source": {
            "what": SOURCE_NAME,
            "origin": "public repository infinigence/SpecEE, folder SpecEE_cloud/llama-7b/, commit "
                      "cd09de7ea91aa84908268a6b296895a66a39202c",
            "folder_name": source.name,
            "files_sha256": sha,
            "other_files_sha256": extra_files,
            "format": "torch.save(module) zip archives of __main__.MLP (fc1 Linear(12, 512), relu, fc2 Linear(512, 1), "
                      "sigmoid), float32; read by specee/early_exit/authors.py without executing the pickle",
        },
        "licence": f"{LICENCE} (LICENSE.txt in this folder, copied from the authors' repository)",
        "conversion": "weights re-laid out, values unchanged: w1[l] = fc1.weight.T, b1[l] = fc1.bias, "
                      "w2[l] = fc2.weight[0], b2[l] = fc2.bias[0] of model{l}.pth; the authors run them in float16",
        "feature_definition": AUTHORS_FEATURE_DEFINITION,
        "harness_features": "the harness's features equal theirs with early_exit.delta_from=authors (the "
                            "specee_*_authors ablations set it); previous_evaluated differs only at a token's "
                            "first scheduled layer, where it subtracts p_prev = 1/K and they subtract nothing "
                            "(tests/test_authors_bank.py pins both)",
        "label": "the authors' (layer l's token == the final token, collected with every layer evaluated)",
        "authors_schedule": {"offline": list(AUTHORS_OFFLINE_7B), "online_offsets": list(AUTHORS_ONLINE_OFFSETS),
                             "online_history": AUTHORS_ONLINE_HISTORY,
                             "placement": "placement=authors_llama2_7b"},
        "command": f"python run.py experiment=import_predictors model={model}",
    }
