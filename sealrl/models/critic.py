"""PPO critic: a causal-LM backbone with a scalar value head.

V(s_t) is read from the hidden state at the position that predicts response token t, i.e. the
state the policy was in when it chose action t; this is the same alignment as the actor's
log-probs (`response_window`), so values[:, j] and log_probs[:, j] describe the same decision.
The extra value after the last response token is the GAE bootstrap for truncated responses
(a terminated response ignores it).

Saved as the backbone's own `save_pretrained` folder plus `value_head.safetensors`, so the
backbone loads in plain transformers and nothing is pickled.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModel, PretrainedConfig, PreTrainedModel

from sealrl.models.hf import quiet
from sealrl.models.logprobs import pad_batch, response_window

VALUE_HEAD_FILE = "value_head.safetensors"


class CriticModel(nn.Module):
    """Backbone (the base model of a causal LM, no LM head) + nn.Linear(hidden, 1)."""

    def __init__(self, backbone: PreTrainedModel, value_head: nn.Linear | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        # nn.Linear's default init: callers seed torch before construction for determinism.
        self.value_head = value_head if value_head is not None else nn.Linear(hidden, 1)
        self.value_head.to(device=next(backbone.parameters()).device, dtype=torch.float32)

    @classmethod
    @quiet
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", trust_remote_code: bool = False,
                        ) -> "CriticModel":
        """Backbone from a local causal-LM (or critic) folder; head loaded if saved, else new."""
        folder = Path(path)
        backbone = AutoModel.from_pretrained(folder, local_files_only=True, dtype=dtype,
                                             use_safetensors=True,
                                             trust_remote_code=trust_remote_code).to(device)
        critic = cls(backbone)
        if (folder / VALUE_HEAD_FILE).is_file():
            critic.value_head.load_state_dict(load_file(folder / VALUE_HEAD_FILE, device=str(device)))
        return critic

    @classmethod
    def from_config(cls, config: PretrainedConfig, seed: int = 0) -> "CriticModel":
        """A randomly initialised critic of the given architecture (deterministic in `seed`)."""
        torch.manual_seed(seed)
        return cls(AutoModel.from_config(config))

    @classmethod
    def from_causal_lm(cls, model: PreTrainedModel) -> "CriticModel":
        """A critic whose backbone starts as a copy of a causal LM's base model."""
        return cls(copy.deepcopy(model.base_model))

    @quiet
    def save(self, path: str | Path) -> Path:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(folder)
        state = {k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()}
        save_file(state, folder / VALUE_HEAD_FILE)
        return folder

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """Value at every position, (B, T) float32."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False).last_hidden_state
        # a new tensor, not a view: FSDP2 hooks a root module's outputs for the backward, and an
        # in-place op on a view of them would drop that hook silently
        return self.value_head(hidden.float()).squeeze(-1).clone()  # (B, T)

    def values(self, prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0,
               ) -> tuple[Tensor, Tensor, Tensor]:
        """(values (B,R), last_values (B,), response_mask (B,R)).

        values[:, j] = V(state before response token j); 0 on padding.
        last_values[b] = V(state after the last response token of row b) (after the prompt
        when the response is empty).
        """
        device = next(self.parameters()).device
        batch = pad_batch(prompts, responses, pad_id, device)
        hidden = self.backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               position_ids=batch.position_ids, use_cache=False).last_hidden_state
        window = response_window(hidden, batch, extra=1)  # (B, R+1, H)
        v = self.value_head(window.float()).squeeze(-1)  # (B, R+1)
        R = batch.response_width
        values = v[:, :R] * batch.response_mask  # (B, R)
        last_values = v.gather(1, batch.response_lens[:, None]).squeeze(1).clone()  # (B,) not a view (forward)
        return values, last_values, batch.response_mask
