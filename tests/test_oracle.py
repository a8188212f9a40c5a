import pytest
import torch

from conftest import random_lm
from specee.bench.oracle import layer_predictions, oracle_layers, oracle_summary
from specee.decoding.dense import DenseDecoder
from specee.runtime.layerwise import LayerwiseLM


def test_oracle_layers_on_a_toy_trace():
    # 3 tokens, 5 layers. Token 7: right from layer 2 on. Token 8: right at layer 1, wrong at 2-3,
    # right again at 4-5. Token 9: right only at the last layer.
    preds = torch.tensor([[1, 7, 7, 7, 7],
                          [8, 2, 2, 8, 8],
                          [3, 3, 3, 3, 9]])
    first, stable = oracle_layers(preds, [7, 8, 9])
    assert first == [2, 1, 5] and stable == [2, 4, 5]
    s = oracle_summary(first, stable, 5)
    assert s["oracle_avg_layers"] == pytest.approx(8 / 3) and s["oracle_stable_avg_layers"] == pytest.approx(11 / 3)
    assert s["ideal_speedup"] == pytest.approx(5 / (8 / 3))


def test_layer_predictions_last_layer_is_the_dense_output():
    """Teacher forcing the dense output reproduces it at the last layer, so the oracle reads
    the same hidden states dense decoding produced."""
    rt = LayerwiseLM(random_lm("llama", layers=4))
    ids = torch.randint(1, 101, (1, 9), generator=torch.Generator().manual_seed(3))
    tokens = DenseDecoder(rt).generate(ids, 16).tokens
    preds = layer_predictions(rt, ids, tokens)
    assert preds.shape == (15, 4)
    assert preds[:, -1].tolist() == tokens[1:]
    first, stable = oracle_layers(preds, tokens[1:])
    assert all(1 <= f <= s <= 4 for f, s in zip(first, stable))
