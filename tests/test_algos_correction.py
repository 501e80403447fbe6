"""Golden values for sealrl.algos.correction, derived by hand in the comments."""
import math

import pytest
import torch
from torch.testing import assert_close

from sealrl.algos import importance_weights, mismatch_metrics, rejection_mask

t = torch.tensor

# x = old - rollout = [0.5, -0.5, 1.0 | pad] in row 0, [0.2, pad...] in row 1
OLD = [[0.5, -0.5, 1.0, 50.0], [0.2, 0.0, 0.0, 0.0]]
ROLLOUT = [[0.0, 0.0, 0.0, -50.0], [0.0, 0.0, 0.0, 0.0]]
MASK = [[1, 1, 1, 0], [1, 0, 0, 0]]


def test_importance_weights_token_golden():
    old = t(OLD, requires_grad=True)
    w = importance_weights(old, t(ROLLOUT), t(MASK), level="token", cap=2.0)
    # e^0.5 = 1.6487, e^-0.5 = 0.6065, e^1 = 2.718 -> capped at 2; e^0.2 = 1.2214; padding 0
    assert_close(w, t([[math.exp(0.5), math.exp(-0.5), 2.0, 0.0],
                       [math.exp(0.2), 0.0, 0.0, 0.0]]))
    assert not w.requires_grad


def test_importance_weights_sequence_golden():
    w = importance_weights(t(OLD), t(ROLLOUT), t(MASK), level="sequence", cap=2.0)
    # row 0: exp(0.5 - 0.5 + 1.0) = e = 2.718 -> capped at 2 on every valid token
    # row 1: exp(0.2) = 1.2214
    assert_close(w, t([[2.0, 2.0, 2.0, 0.0], [math.exp(0.2), 0.0, 0.0, 0.0]]))
    w = importance_weights(t(OLD), t(ROLLOUT), t(MASK), level="sequence", cap=3.0)
    assert_close(w[0], t([math.e, math.e, math.e, 0.0]))
    with pytest.raises(ValueError, match="level"):
        importance_weights(t(OLD), t(ROLLOUT), t(MASK), level="batch")


@pytest.mark.parametrize("kind, threshold, row0", [
    # k1 = rollout - old = [-0.5, 0.5, -1.0]: <= 0.3 keeps tokens 0 and 2
    ("k1", 0.3, [True, False, True, False]),
    # k2 = 0.5 x^2 = [0.125, 0.125, 0.5]: <= 0.3 keeps tokens 0 and 1
    ("k2", 0.3, [True, True, False, False]),
    # k3 = e^x - 1 - x = [0.1487, 0.1065, 0.7183]: <= 0.12 keeps token 1 only
    ("k3", 0.12, [False, True, False, False]),
])
def test_rejection_mask_token_golden(kind, threshold, row0):
    keep = rejection_mask(t(OLD), t(ROLLOUT), t(MASK), level="token", kind=kind,
                          threshold=threshold)
    assert keep.dtype == torch.bool
    assert keep[0].tolist() == row0  # padding (index 3, with a huge divergence) is never kept
    assert keep[1].tolist() == [True, False, False, False]  # k of 0.2 is small under all kinds


def test_rejection_mask_sequence_golden():
    # row 0 k3 mean = (0.14872 + 0.10653 + 0.71828) / 3 = 0.32451
    # row 1 k3 = e^0.2 - 1.2 = 0.02140
    keep = rejection_mask(t(OLD), t(ROLLOUT), t(MASK), level="sequence", kind="k3", threshold=0.3)
    assert keep.tolist() == [[False] * 4, [True, False, False, False]]
    keep = rejection_mask(t(OLD), t(ROLLOUT), t(MASK), level="sequence", kind="k3", threshold=0.33)
    assert keep.tolist() == [[True, True, True, False], [True, False, False, False]]


def test_mismatch_metrics_golden():
    lp = t([[-1.0, -2.0], [-7.0, 3.0]])
    rp = t([[-1.5, -2.0], [9.0, 9.0]])
    mask = t([[1, 1], [0, 0]])  # row 1 is garbage and masked
    m = mismatch_metrics(lp, rp, mask)
    # x = lp - rp = [0.5, 0] over the 2 valid tokens
    assert_close(m["k1"], t(-0.25))                                   # mean(rp - lp)
    assert_close(m["k3"], t((math.exp(0.5) - 1.5) / 2))               # (0.14872 + 0) / 2
    assert_close(m["log_prob_abs_diff_max"], t(0.5))
    assert_close(m["prob_abs_diff_mean"], t((math.exp(-1) - math.exp(-1.5)) / 2))  # 0.14475/2
    assert_close(m["ppl_train"], t(math.exp(1.5)))                    # exp(-(-1 - 2)/2)
    assert_close(m["ppl_rollout"], t(math.exp(1.75)))                 # exp(-(-1.5 - 2)/2)
    assert_close(m["ppl_ratio"], t(math.exp(-0.25)))                  # row 0 only: e^(1.5-1.75)


def test_mismatch_metrics_nothing_valid():
    m = mismatch_metrics(torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3))
    assert {k: v.item() for k, v in m.items()} == {
        "k1": 0.0, "k3": 0.0, "log_prob_abs_diff_max": 0.0, "prob_abs_diff_mean": 0.0,
        "ppl_train": 1.0, "ppl_rollout": 1.0, "ppl_ratio": 0.0}


def test_correction_metrics_golden():
    from sealrl.algos import correction_metrics
    # 3 rows: 3 candidates, 2 candidates, none (all masked)
    candidates = t([[1, 1, 1], [1, 1, 0], [0, 0, 0]]).bool()
    kept = t([[1, 0, 1], [1, 1, 0], [0, 0, 0]]).bool()     # one token of row 0 rejected
    weights = t([[0.5, 9.0, 2.0], [1.0, 1.5, 7.0], [3.0, 3.0, 3.0]])
    m = {k: float(v) for k, v in correction_metrics(candidates, kept, weights).items()}
    # 1 of 5 candidates rejected; 1 of the 2 rows with candidates lost a token;
    # weights over the 4 kept tokens 0.5, 2, 1, 1.5: mean 5 / 4, max 2, min 0.5
    assert m == pytest.approx({"rejected_token_frac": 0.2, "rejected_seq_frac": 0.5,
                               "is_weight_mean": 1.25, "is_weight_max": 2.0, "is_weight_min": 0.5})
    assert set(correction_metrics(candidates, None, weights)) == {"is_weight_mean", "is_weight_max", "is_weight_min"}
    assert set(correction_metrics(candidates, kept, None)) == {"rejected_token_frac", "rejected_seq_frac"}
