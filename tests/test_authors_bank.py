"""The SpecEE authors' predictor bank: read without running its pickles, converted exactly, and their
feature definition held against the harness's.

Synthetic files in the authors' exact layout (a class ``MLP`` pickled from ``__main__`` by
``torch.save(module)``) test the reader everywhere; the authors' own 32 files are tested when the
data root (SPECEE_DATA_ROOT) holds them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from specee.early_exit import authors
from specee.early_exit.authors import (AUTHORS_K, AUTHORS_OFFLINE_7B, authors_feature, authors_mlp_prob,
                                       authors_schedule, authors_token_features, load_authors_bank,
                                       read_authors_mlp)
from specee.early_exit.features import SpecProbe, delta_probe_layers, features_from_logits, initial_p, spec_features
from specee.early_exit.predictor import PredictorBank
from specee.early_exit.schedule import build_schedule
from specee.errors import SpeceeError

ROOT = Path(__file__).resolve().parents[1]
DATA = (ROOT / os.environ.get("SPECEE_DATA_ROOT", "data")).resolve()
REAL = DATA / "specee_authors_llama2_7b_predictors"
SHIPPED = ROOT / "specee" / "artifacts" / "llama2_7b_predictors_authors"


class MLP(nn.Module):
    """The authors' class, as their training script defines it (pickled under ``__main__``)."""

    def __init__(self, input_size, hidden_size, output_size):
        super().__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden_size, output_size)
        self.sigmoid = nn.Sigmoid()

    def forward(self, x):
        return self.sigmoid(self.fc2(self.relu(self.fc1(x))))


class Payload:
    """Would run a shell command when unpickled by a plain unpickler."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def as_main(monkeypatch):
    """Pickle MLP (and Payload) as ``__main__.<name>``, as the authors' script did."""
    import __main__
    for cls in (MLP, Payload):
        monkeypatch.setattr(cls, "__module__", "__main__")
        monkeypatch.setattr(__main__, cls.__name__, cls, raising=False)


def _mlp(seed: int, n_in: int = 12, hidden: int = 16) -> MLP:
    torch.manual_seed(seed)
    return MLP(n_in, hidden, 1)


def _write_bank(folder: Path, n: int = 32, hidden: int = 16) -> list[MLP]:
    folder.mkdir(parents=True, exist_ok=True)
    mlps = [_mlp(i, hidden=hidden) for i in range(n)]
    for i, m in enumerate(mlps):
        torch.save(m, folder / f"model{i}.pth")
    (folder / "LICENSE.txt").write_text("Apache License\nVersion 2.0, January 2004\n")
    return mlps


# -- the reader --------------------------------------------------------------------------------
def test_synthetic_files_read_exactly(tmp_path, as_main):
    m = _mlp(3)
    torch.save(m, tmp_path / "model0.pth")
    got = read_authors_mlp(tmp_path / "model0.pth")
    assert torch.equal(got["fc1_weight"], m.fc1.weight.data) and torch.equal(got["fc1_bias"], m.fc1.bias.data)
    assert torch.equal(got["fc2_weight"], m.fc2.weight.data) and torch.equal(got["fc2_bias"], m.fc2.bias.data)
    # the class pickled really is __main__.MLP, the layout the reader is built for
    assert b"__main__\nMLP" in __import__("zipfile").ZipFile(tmp_path / "model0.pth").read("model0/data.pkl")


def test_synthetic_bank_decides_as_the_mlps(tmp_path, as_main):
    mlps = _write_bank(tmp_path / "src")
    bank, sha = load_authors_bank(tmp_path / "src", 32)
    assert sorted(sha) == sorted(f"model{i}.pth" for i in range(32))
    x = torch.randn(2000, 12) * 3
    with torch.no_grad():
        for i, m in enumerate(mlps):
            want = m(x).squeeze(-1) > 0.5
            assert torch.equal(bank.decide(i, x), want), i
            assert bank.fires(i, x[0]) == bool(want[0])  # the decode path (one token, addmv)
            assert 0 < int(want.sum()) < len(x)  # both decisions occur: the comparison can fail


def test_payload_refused_and_not_run(tmp_path, as_main):
    marker = tmp_path / "ran"
    m = _mlp(0)
    m.note = Payload(marker)  # travels in the module's __dict__, as any attribute would
    torch.save(m, tmp_path / "model0.pth")
    # the payload is live: a plain unpickler runs it (our own file, in a temporary folder)
    torch.load(tmp_path / "model0.pth", weights_only=False)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(SpeceeError) as err:
        read_authors_mlp(tmp_path / "model0.pth")
    msg = str(err.value)
    assert "\n" not in msg and "model0.pth" in msg and "system" in msg and "nothing in the file was run" in msg
    assert not marker.exists()


def test_unknown_module_refused(tmp_path, as_main):
    m = _mlp(0)
    m.relu = nn.Dropout()  # a torch class, but not in the authors' layout
    torch.save(m, tmp_path / "model0.pth")
    with pytest.raises(SpeceeError, match=r"model0\.pth refused: .*torch\.nn\.modules\.dropout\.Dropout"):
        read_authors_mlp(tmp_path / "model0.pth")


def test_forward_hook_refused(tmp_path, as_main):
    m = _mlp(0)
    m.register_forward_hook(_hook)  # a function reference: code the authors' runtime would call
    torch.save(m, tmp_path / "model0.pth")
    with pytest.raises(SpeceeError, match="_hook"):
        read_authors_mlp(tmp_path / "model0.pth")


def _hook(module, args, out):
    return out


@pytest.mark.parametrize("n_in,match", [(13, r"shapes .*not an MLP 3K=12"),
                                        (4104, r"other feature layout .*not supported")])
def test_wrong_shapes_refused(tmp_path, as_main, n_in, match):
    torch.save(_mlp(0, n_in=n_in), tmp_path / "model0.pth")
    with pytest.raises(SpeceeError, match=match) as err:
        read_authors_mlp(tmp_path / "model0.pth")
    assert "\n" not in str(err.value)


def test_wrong_output_size_refused(tmp_path, as_main):
    torch.save(MLP(12, 16, 2), tmp_path / "model0.pth")
    with pytest.raises(SpeceeError, match=r"'fc2\.weight': \(2, 16\)"):
        read_authors_mlp(tmp_path / "model0.pth")


def test_nan_refused(tmp_path, as_main):
    m = _mlp(0)
    with torch.no_grad():
        m.fc2.weight[0, 3] = float("nan")
    torch.save(m, tmp_path / "model0.pth")
    with pytest.raises(SpeceeError, match=r"model0\.pth: fc2\.weight holds non-finite") as err:
        read_authors_mlp(tmp_path / "model0.pth")
    assert "\n" not in str(err.value)


def test_not_an_archive_refused(tmp_path):
    (tmp_path / "model0.pth").write_bytes(b"\x80\x02}q\x00.")  # a bare pickle, not torch.save's zip
    with pytest.raises(SpeceeError, match="not a torch zip archive"):
        read_authors_mlp(tmp_path / "model0.pth")


def test_layer_counts_refused(tmp_path, as_main):
    _write_bank(tmp_path / "short", n=24)
    with pytest.raises(SpeceeError, match=r"holds 24 predictors; .*32-layer"):
        load_authors_bank(tmp_path / "short")
    _write_bank(tmp_path / "full")
    with pytest.raises(SpeceeError, match="this model has 40"):
        load_authors_bank(tmp_path / "full", 40)
    (tmp_path / "full" / "model5.pth").unlink()
    with pytest.raises(SpeceeError, match=r"lacks model5\.pth"):
        load_authors_bank(tmp_path / "full", 32)


# -- the authors' own files ----------------------------------------------------------------------
needs_real = pytest.mark.skipif(not REAL.is_dir(), reason=f"the authors' predictor folder is not under the data "
                                f"root ({REAL.name}); set SPECEE_DATA_ROOT to a data root holding it")


def _torch_reader(path: Path) -> nn.Module:
    """torch's own restricted (weights_only) unpickler, the authors' classes allow-listed: an
    independent reader to hold ours against (it never runs pickle code either)."""
    import __main__
    had = getattr(__main__, "MLP", None)
    MLP.__module__, __main__.MLP = "__main__", MLP
    try:
        with torch.serialization.safe_globals([MLP, nn.Linear, nn.ReLU, nn.Sigmoid, set]):
            return torch.load(path, weights_only=True, map_location="cpu")
    finally:
        MLP.__module__ = __name__
        if had is None:
            del __main__.MLP
        else:
            __main__.MLP = had


@needs_real
def test_authors_bank_decides_as_their_mlps():
    bank, sha = load_authors_bank(REAL, 32)
    listed = dict(reversed(line.split()) for line in (REAL / "SHA256SUMS").read_text().splitlines() if line.strip())
    assert sha == {name: listed[name] for name in sha}
    g = torch.Generator().manual_seed(0)
    # plausible features: 4 logits, their softmax, a gap in [-1, 1]
    z = torch.randn(4000, 4, generator=g) * 4
    p = torch.softmax(z, -1)
    x = torch.cat([z, p, p - torch.softmax(torch.randn(4000, 4, generator=g) * 4, -1)], -1)
    fired = 0
    with torch.no_grad():
        for i in range(32):
            theirs = _torch_reader(REAL / f"model{i}.pth")
            want = theirs(x).squeeze(-1) > 0.5
            assert torch.equal(bank.decide(i, x), want), i
            assert torch.equal(authors_mlp_prob(read_authors_mlp(REAL / f"model{i}.pth"), x) > 0.5, want), i
            fired += int(want.sum())
    assert 0 < fired < 32 * len(x)


@needs_real
def test_shipped_bank_is_the_authors():
    bank, sha = load_authors_bank(REAL, 32)
    shipped, card = PredictorBank.load(SHIPPED, 32, AUTHORS_K, 0.5)
    for n in ("w1", "b1", "w2", "b2", "has"):
        assert torch.equal(getattr(shipped, n), getattr(bank, n)), n
    assert card["source"]["files_sha256"] == sha


def test_shipped_bank_card():
    """The committed conversion: its card names its source, licence and every input's sha256."""
    card = json.loads((SHIPPED / "predictors_card.json").read_text())
    assert card["num_layers"] == 32 and card["k"] == 4 and card["hidden"] == 512
    assert sorted(card["source"]["files_sha256"]) == sorted(f"model{i}.pth" for i in range(32))
    assert all(len(h) == 64 for h in card["source"]["files_sha256"].values())
    assert card["licence"].startswith("Apache-2.0") and "LICENSE.txt" in card["source"]["other_files_sha256"]
    assert "Apache License" in (SHIPPED / "LICENSE.txt").read_text()
    assert "Apache-2.0" in (SHIPPED / "NOTICE.md").read_text()
    bank, _ = PredictorBank.load(SHIPPED, 32, 4, 0.5)
    assert bool(bank.has.all()) and bool(torch.isfinite(bank.w1).all())


# -- their feature against the harness's ------------------------------------------------------------
def _token(seed: int, d: int = 24, vocab: int = 50, layers: int = 32):
    """One token's hidden states at every layer, a Llama RMSNorm and LM head, and a speculative set."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    g = torch.Generator().manual_seed(seed)
    norm = LlamaRMSNorm(d, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(d, generator=g))
    head = nn.Linear(d, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, d, generator=g))
    hs = [torch.randn(1, 1, d, generator=g) * (1 + l / 4) for l in range(layers)]
    spec = torch.tensor([7, 3, 41, 12])  # the draft's top-4, in rank order
    return SimpleNamespace(norm=norm, lm_head=head), hs, spec


def _harness(rt, hs, spec, scheduled, delta_from):
    """The harness decoder's features at the scheduled layers (specee_ar.decode_one_token's rules):
    p_prev from layer l-1 (probed when unscheduled) or from the last evaluated layer; 1/K at first."""
    probe = SpecProbe(rt, spec)
    out, p_prev = {}, initial_p(len(spec), spec)
    for layer in range(len(hs)):
        if layer in scheduled:
            out[layer], p_prev = features_from_logits(probe.logits(hs[layer]), p_prev)
        elif delta_from == "previous_layer" and layer + 1 in scheduled:
            p_prev = torch.softmax(probe.logits(hs[layer]), -1)
    return out


def _authors(rt, hs, spec, scheduled):
    with torch.no_grad():
        normed = {l: rt.norm(hs[l]).reshape(-1) for l in scheduled}
        return authors_token_features(normed, scheduled, rt.lm_head.weight[spec])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_features_against_the_authors(seed):
    """Pins how the harness's 12 values relate to the authors' on the same hidden states:
    - the order (z, softmax z, gap) and the first 8 values agree (to float32 rounding: the harness
      folds the norm's weight into the K rows);
    - with delta_from=previous_evaluated the gap agrees at every scheduled layer but the token's
      first, where the harness subtracts 1/K and the authors nothing;
    - with delta_from=previous_layer (the default) the gap differs wherever layer l-1 is not scheduled."""
    rt, hs, spec = _token(seed)
    k = len(spec)
    scheduled = sorted(set(AUTHORS_OFFLINE_7B) | {9, 11})  # an online pair before the offline set
    theirs = _authors(rt, hs, spec, scheduled)
    first = scheduled[0]
    for delta_from in ("previous_evaluated", "previous_layer"):
        ours = _harness(rt, hs, spec, set(scheduled), delta_from)
        assert sorted(ours) == scheduled
        for layer in scheduled:
            torch.testing.assert_close(ours[layer][:2 * k], theirs[layer][:2 * k], rtol=1e-5, atol=1e-6)
    evaluated = _harness(rt, hs, spec, set(scheduled), "previous_evaluated")
    for layer in scheduled:
        gap_ours, gap_theirs = evaluated[layer][2 * k:], theirs[layer][2 * k:]
        if layer == first:
            torch.testing.assert_close(gap_ours, gap_theirs - 1 / k, rtol=0, atol=1e-6)
            assert (gap_ours - gap_theirs).abs().min() > 0.2  # the 1/K = 0.25 shift is there
        else:
            torch.testing.assert_close(gap_ours, gap_theirs, rtol=1e-5, atol=1e-6)
    default = _harness(rt, hs, spec, set(scheduled), "previous_layer")
    for layer in scheduled:
        gap_ours, gap_theirs = default[layer][2 * k:], theirs[layer][2 * k:]
        if layer != first and layer - 1 in scheduled:
            torch.testing.assert_close(gap_ours, gap_theirs, rtol=1e-5, atol=1e-6)
        else:
            assert (gap_ours - gap_theirs).abs().max() > 1e-3, layer


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_delta_from_authors_is_the_authors_feature_definition(seed):
    """early_exit.delta_from=authors (the specee_*_authors ablations): the decoder's own pieces (its
    p_prev before the first scheduled layer, its probe-only layers) give the authors' 12 values at
    every scheduled layer, the first included."""
    rt, hs, spec = _token(seed)
    scheduled = sorted(set(AUTHORS_OFFLINE_7B) | {9, 11})
    theirs = _authors(rt, hs, spec, scheduled)
    eligible = [layer in scheduled for layer in range(len(hs))]
    probe_only = delta_probe_layers(eligible, "authors")
    assert not any(probe_only)  # no probe at unscheduled layers: the last evaluated layer's p
    probe, p_prev = SpecProbe(rt, spec), initial_p(len(spec), spec, "authors")
    for layer in range(len(hs)):
        if eligible[layer]:
            ours, p_prev = features_from_logits(probe.logits(hs[layer]), p_prev)
            torch.testing.assert_close(ours, theirs[layer], rtol=1e-5, atol=1e-6)


def test_training_features_against_the_authors():
    """Collection (every layer evaluated, as both the harness and the authors train): the gap is
    p_l - p_{l-1} in both, except at layer 0 (harness p_0 - 1/K, authors p_0)."""
    rt, hs, spec = _token(5)
    every = list(range(32))
    theirs, ours = _authors(rt, hs, spec, every), _harness(rt, hs, spec, set(every), "previous_layer")
    torch.testing.assert_close(ours[0][8:], theirs[0][8:] - 0.25, rtol=0, atol=1e-6)
    for layer in every[1:]:
        torch.testing.assert_close(ours[layer], theirs[layer], rtol=1e-5, atol=1e-6)


def test_authors_feature_layout():
    """Their order: 4 logits, 4 probabilities, 4 gaps; the first gap is the probabilities themselves."""
    w, h = torch.randn(4, 8), torch.randn(8)
    f, p = authors_feature(h, w, None)
    assert f.shape == (12,) and torch.equal(f[:4], w @ h) and torch.equal(f[4:8], p) and torch.equal(f[8:], p)
    f2, _ = authors_feature(h * 2, w, p)
    assert torch.equal(f2[8:], f2[4:8] - p)
    # the harness's helper on the same normed state: same logits and probabilities, gap against 1/K
    ours, _ = spec_features(h, w, initial_p(4, h))
    assert torch.equal(ours[:8], f[:8]) and torch.allclose(ours[8:], f[8:] - 0.25)


# -- their schedule as a shipped placement -----------------------------------------------------------
def _placement():
    node = OmegaConf.load(ROOT / "conf" / "placement" / "authors_llama2_7b.yaml")
    node.pop("defaults")
    node.profile_path = str(ROOT / "specee" / "artifacts" / "llama2_7b_exit_profile_authors")
    node.coverage = None
    return node


def test_placement_is_the_authors_schedule():
    p = _placement()
    sched = build_schedule(p, 32, Path(p.profile_path))
    state = sched.new_request()
    history = []
    g = torch.Generator().manual_seed(0)
    for step in range(60):
        # layer 31 never runs a predictor in either (the harness's can_exit; their `< 31`)
        ours = [i for i, on in enumerate(sched.active(state)) if on and i < 31]
        if len(history) >= 5:
            assert ours == authors_schedule(history), step
        else:  # warm-up: the harness schedules every layer, the authors the offline set only
            assert ours == list(range(31)) and authors_schedule(history) == list(AUTHORS_OFFLINE_7B)
        exit_layer = int(torch.randint(0, 32, (1,), generator=g))  # 0-based; 31 = no exit
        sched.record(state, exit_layer)
        history.append(exit_layer + 1)  # the authors record 1-based exit layers (32 = none)
    # history carries over to the next request, as in their inference script
    assert sched.new_request() is state


# -- the recipe ------------------------------------------------------------------------------------
def _run(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_import_recipe(tmp_path, as_main):
    mlps = _write_bank(tmp_path / "data" / "specee_authors_llama2_7b_predictors", hidden=8)
    out = tmp_path / "bank"
    args = ["experiment=import_predictors", "model=llama2_7b", f"experiment.out_dir={out}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    r = _run(*args, env={"SPECEE_DATA_ROOT": str(tmp_path / "data")})
    assert r.returncode == 0, r.stderr[-2000:]
    bank, card = PredictorBank.load(out, 32, 4, 0.5)
    x = torch.randn(500, 12) * 3
    with torch.no_grad():
        for i in (0, 17, 31):
            assert torch.equal(bank.decide(i, x), mlps[i](x).squeeze(-1) > 0.5)
    src = tmp_path / "data" / "specee_authors_llama2_7b_predictors"
    assert card["source"]["files_sha256"]["model3.pth"] == authors.sha256_file(src / "model3.pth")
    assert card["source"]["other_files_sha256"]["LICENSE.txt"] == authors.sha256_file(src / "LICENSE.txt")
    assert (out / "LICENSE.txt").read_text() == (src / "LICENSE.txt").read_text() and (out / "NOTICE.md").is_file()
    assert str(tmp_path) not in (out / "predictors_card.json").read_text()  # no machine paths in a shipped card

    # a payload in one file: the run stops in one line, the payload never runs, the bank is untouched
    marker = tmp_path / "ran"
    bad = _mlp(4, hidden=8)
    bad.note = Payload(marker)
    torch.save(bad, src / "model4.pth")
    before = (out / "predictors.safetensors").read_bytes()
    r = _run(*args, "force=true", f"hydra.run.dir={tmp_path / 'run2'}", env={"SPECEE_DATA_ROOT": str(tmp_path / "data")})
    assert r.returncode == 2, r.stderr[-2000:]
    err = [line for line in r.stderr.splitlines() if line.startswith("specee: error:")]
    assert len(err) == 1 and "model4.pth refused" in err[0] and "system" in err[0], r.stderr[-2000:]
    assert not marker.exists()
    assert (out / "predictors.safetensors").read_bytes() == before


def test_import_recipe_refuses_another_model(tmp_path):
    r = _run("experiment=import_predictors", "model=tiny", f"experiment.out_dir={tmp_path / 'bank'}",
             f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2 and "trained for model=llama2_7b" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "bank").exists()
