"""Teacher-forced per-token log-probs and entropy of given responses.

The log-prob space is the one DESIGN section 3 fixes for every role: log_softmax(logits / T)
over the full vocabulary, no top-k/top-p filtering. The rollout engine calls the same
`token_log_probs` on its own logits, so behaviour and training log-probs differ only by the
logits themselves (the parity test holds that difference under 1e-5 in fp32).

The layout (`pad_batch`): prompts left-padded to width P, responses right-padded to width R:

    input_ids   [pad pad p0 p1 p2 | r0 r1 r2 pad]      (B, P+R)
    position    [ 0   0  0  1  2  |  3  4  5   6]      per-row, counted over real tokens
    logits that predict r_j sit at column P-1+j, so every row's response window is the same
    slice [P-1, P-1+R) and column j of the result is the j-th response token of the row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PaddedBatch:
    """Left-padded prompts + right-padded responses; see the module docstring for the layout."""

    input_ids: Tensor       # (B, P+R) long
    attention_mask: Tensor  # (B, P+R) long, 1 = real token
    position_ids: Tensor    # (B, P+R) long
    response_ids: Tensor    # (B, R) long, pad after each response
    response_mask: Tensor   # (B, R) float, 1 = action token
    prompt_width: int       # P

    @property
    def response_width(self) -> int:
        return self.response_ids.shape[1]

    @property
    def response_lens(self) -> Tensor:
        return self.response_mask.sum(1).long()  # (B,)


def _check_pairs(prompts: list[list[int]], responses: list[list[int]]) -> None:
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
    for i, p in enumerate(prompts):
        if len(p) == 0:  # the first response token needs a position that predicts it
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")


def pad_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0,
              device: str | torch.device = "cpu") -> PaddedBatch:
    """Lay out (prompt, response) pairs as one padded batch (left-pad prompt, right-pad response)."""
    _check_pairs(prompts, responses)
    P = max(len(p) for p in prompts)
    R = max((len(r) for r in responses), default=0)
    B = len(prompts)
    input_ids = torch.tensor([[pad_id] * (P - len(p)) + list(p) + list(r) + [pad_id] * (R - len(r))
                              for p, r in zip(prompts, responses)], dtype=torch.long).view(B, P + R)
    columns = torch.arange(P + R)[None, :]
    starts = torch.tensor([P - len(p) for p in prompts])[:, None]
    ends = torch.tensor([P + len(r) for r in responses])[:, None]
    attention_mask = ((columns >= starts) & (columns < ends)).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # (B, P+R)
    response_mask = attention_mask[:, P:].float()  # (B, R)
    return PaddedBatch(input_ids.to(device), attention_mask.to(device), position_ids.to(device),
                       input_ids[:, P:].to(device), response_mask.to(device), P)


def response_window(x: Tensor, batch: PaddedBatch, extra: int = 0) -> Tensor:
    """Columns of a per-position tensor (B, P+R, ...) that predict the response tokens.

    Column j of the result is the state *before* response token j (it predicts token j). With
    `extra=1` one more column is kept: the state after the last column, which the critic uses
    for the bootstrap value. The critic and the log-prob code share this one alignment.
    """
    start = batch.prompt_width - 1
    return x[:, start:start + batch.response_width + extra]  # (B, R+extra, ...)


def token_log_probs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / T)[token] computed as z[token] - logsumexp(z), in fp32.

    logits (..., V), tokens (...) -> (...). Used by the rollout sampler and the teacher-forced
    path alike, so both sides apply the exact same formula.
    """
    z = logits.float() / temperature
    picked = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / T): logsumexp(z) - sum(p * z). (..., V) -> (...)."""
    z = logits.float() / temperature
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(-1)


def response_logits(model, batch: PaddedBatch) -> Tensor:
    """Logits that predict each response token, (B, R, V), gradients flowing.

    `logits_to_keep` makes the LM head run on the last R+1 positions only (prompt logits are
    never needed); the last of those predicts past the end and is dropped.
    """
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, use_cache=False,
                logits_to_keep=batch.response_width + 1)
    return out.logits[:, :-1]  # (B, R, V)


def _masked_outputs(logits: Tensor, tokens: Tensor, mask: Tensor, temperature: float,
                    with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    log_probs = token_log_probs(logits, tokens, temperature) * mask  # (B, R), 0 on padding
    entropy = token_entropy(logits, temperature) * mask if with_entropy else None
    return log_probs, entropy


def response_log_probs(model, prompts: list[list[int]], responses: list[list[int]],
                       temperature: float = 1.0, pad_id: int = 0, with_entropy: bool = False,
                       ) -> tuple[Tensor, Tensor | None, Tensor]:
    """Teacher-forced (log_probs (B,R), entropy (B,R) or None, response_mask (B,R)).

    Padding positions hold 0 in log_probs and entropy. Call under torch.no_grad() for old/ref
    log-probs; under grad it is the actor's loss input.
    """
    device = next(model.parameters()).device
    batch = pad_batch(prompts, responses, pad_id, device)
    logits = response_logits(model, batch)  # (B, R, V)
    log_probs, entropy = _masked_outputs(logits, batch.response_ids, batch.response_mask,
                                         temperature, with_entropy)
    return log_probs, entropy, batch.response_mask
