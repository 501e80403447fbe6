"""KL estimators, KL-shaped token rewards, and the KL coefficient controllers.

Notation: p = the policy being trained (log_prob), q = the reference (ref_log_prob); tokens are
sampled from the behaviour policy, which is p up to staleness. With log r = log q - log p:

    k1  = log p - log q               = -log r       unbiased for KL(p||q), high variance, can be < 0
    abs = |log p - log q|
    k2  = 0.5 (log p - log q)^2                       biased, >= 0
    k3  = r - 1 - log r                               unbiased for KL(p||q), >= 0, low variance
                                                      (Schulman 2020, "Approximating KL divergence")

Estimators are returned per token, *unmasked*: the caller masks (garbage at padding is fine,
k3 is clamped so it never overflows).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from sealrl.algos.advantages import _last_token_mask


def kl_k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k1 = log p - log q.   (B, T) -> (B, T)"""
    return log_prob - ref_log_prob


def kl_abs(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """abs = |log p - log q|.   (B, T) -> (B, T)"""
    return (log_prob - ref_log_prob).abs()


def kl_k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k2 = 0.5 (log p - log q)^2.   (B, T) -> (B, T)"""
    return 0.5 * (log_prob - ref_log_prob).pow(2)


def kl_k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k3 = exp(log q - log p) - (log q - log p) - 1.   (B, T) -> (B, T)

    As done in practice (e.g. verl's "low_var_kl"): the log-ratio is clamped to [-20, 20] before
    exp (no overflow on padding garbage or rare huge ratios) and the result to [-10, 10]
    (k3 >= 0, so only the upper bound bites). Where a clamp bites the gradient is 0.
    """
    log_r = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
    return (log_r.exp() - log_r - 1.0).clamp(-10.0, 10.0)


def _straight_through(value_fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """Forward value of value_fn, gradient of k2: value.detach() + k2 - k2.detach().

    Why k2's gradient: grad KL(p||q) = E_p[log(p/q) grad log p], and grad k2 = log(p/q) grad log p
    is exactly the sampled integrand. Differentiating k1 or k3 directly does not give this
    (grad k1 = grad log p has expectation 0). The forward value stays the chosen estimator so the
    logged / penalised number is still the KL estimate.
    """
    def estimator(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
        k2 = kl_k2(log_prob, ref_log_prob)
        return value_fn(log_prob, ref_log_prob).detach() + k2 - k2.detach()

    estimator.__name__ = f"{value_fn.__name__}_plus"
    estimator.__doc__ = f"Straight-through: forward {value_fn.__name__}, gradient of k2."
    return estimator


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "abs": kl_abs,
    "k2": kl_k2,
    "k3": kl_k3,
    "k1+": _straight_through(kl_k1),
    "k3+": _straight_through(kl_k3),
    "abs+": _straight_through(kl_abs),
}


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate `KL_ESTIMATORS[kind](log_prob, ref_log_prob)`, unmasked. (B, T) -> (B, T)

    kind: "k1" | "abs" | "k2" | "k3" | "k1+" | "k3+" | "abs+" (see the module docstring;
    "X+" = forward value of X, gradient of k2).
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kl_penalty: kind must be one of {sorted(KL_ESTIMATORS)}, got {kind!r}")
    return KL_ESTIMATORS[kind](log_prob, ref_log_prob)


def shaped_token_rewards(scores: Tensor, kl: Tensor, response_mask: Tensor, beta: float) -> Tensor:
    """KL-in-reward shaping (Ziegler et al. 2019, arXiv:1909.08593, eq. 2; Ouyang et al. 2022 eq. 2).

        r_t = -beta * kl_t + [t is the last valid token] * score

    scores (B,), kl (B, T), response_mask (B, T) -> (B, T), 0 at padding; an all-masked row is
    all zeros (its score has nowhere to go). kl is used as given: pass a detached estimate.
    """
    m = response_mask.bool()
    rewards = torch.where(m, -beta * kl, torch.zeros_like(kl))
    last = _last_token_mask(m)
    return rewards + torch.where(last, scores.unsqueeze(-1).to(kl.dtype), torch.zeros_like(kl))


class FixedKLController:
    """Constant KL coefficient. `update` is a no-op."""

    def __init__(self, beta: float) -> None:
        if beta < 0:
            raise ValueError(f"FixedKLController: beta must be >= 0, got {beta!r}")
        self.beta = float(beta)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"kind": "fixed", "beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "fixed":
            raise ValueError(f"FixedKLController: state kind must be 'fixed', got {state.get('kind')!r}")
        self.beta = float(state["beta"])


class AdaptiveKLController:
    """Proportional KL controller (Ziegler et al. 2019, arXiv:1909.08593, sec. 2.2).

        e_t    = clip(KL_t / target - 1, -0.2, 0.2)
        beta  <- beta * (1 + clip(e_t * n_steps / horizon, -0.2, 0.2))

The outer clip is ours: the paper's factor 1 + e_t n / horizon assumes horizon >> n (10000 vs
512); with n > 5 horizon it goes negative and beta flips sign. Clipping the step keeps beta in
[0, inf) (each update scales it by 0.8 .. 1.2) and equals the paper's rule whenever
n_steps <= horizon, where |e_t n / horizon| <= 0.2 already.

    `current_kl` is the measured KL of the batch (a float; a 0-dim tensor is accepted),
    `n_steps` the number of samples (or steps, as the caller's horizon is counted) it covers.
    `state_dict` is a plain JSON-able dict; `load_state_dict` restores beta, target and horizon
    (the checkpoint is the training position; a changed config is caught by the config hash).
    """

    def __init__(self, init_beta: float, target: float, horizon: float) -> None:
        if init_beta < 0:
            raise ValueError(f"AdaptiveKLController: init_beta must be >= 0, got {init_beta!r}")
        if target <= 0:
            raise ValueError(f"AdaptiveKLController: target must be > 0, got {target!r}")
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon!r}")
        self.beta = float(init_beta)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.beta *= 1.0 + min(max(error * n_steps / self.horizon, -0.2), 0.2)

    def state_dict(self) -> dict:
        return {"kind": "adaptive", "beta": self.beta, "target": self.target,
                "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "adaptive":
            raise ValueError(f"AdaptiveKLController: state kind must be 'adaptive', "
                             f"got {state.get('kind')!r}")
        self.beta = float(state["beta"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])
