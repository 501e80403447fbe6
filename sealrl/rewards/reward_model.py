"""A learned reward model: a Hugging Face sequence classifier with one output (num_labels=1).

The RM has its own tokenizer and chat template (loaded from its folder), which are not the
policy's: the sample is re-formatted from text. With a chat template the input is
messages [user: prompt, assistant: response] rendered by the RM tokenizer; without one it is
prompt + response. Sequences are right-padded, so with a causal RM a padded row gives the same
score as the same row alone (HF pools the last non-pad token).

torch and transformers are imported in `setup()`, not at module import: a pool whose scorer is
rule-based never pays for them. The model is loaded once per process (`setup()`, called by the
pool before a worker takes work, or on first use inline) and is never pickled: a pickled
RewardModelScorer carries only its path and options. Placement: run it inline
(RewardPool(rm, num_scorers=0)) on the driver's device, or in its own process
(RewardPool(rm, num_scorers=1)), where a whole request is one `score_batch` call.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Sequence

from sealrl.rewards.base import RewardSample

# Files whose bytes define the scorer (with every *.safetensors shard); hashed into the version
# when none is given.
_VERSION_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class RewardModelScorer:
    """Scores prompt+response with a local AutoModelForSequenceClassification folder.

    `version` defaults to a hash of the folder's config, weights and tokenizer files (reading
    every weight byte: pass `version` explicitly for a multi-GB model). `batch_size` bounds the
    rows of one forward pass. Scores are the raw logit, float32 on `device`.
    """

    def __init__(self, path: str | Path, name: str = "reward_model", version: str | None = None,
                 device: str = "cpu", batch_size: int = 16) -> None:
        self.path = str(path)
        if not (Path(self.path) / "config.json").is_file():
            raise FileNotFoundError(f"RewardModelScorer: no config.json in {self.path}")
        if batch_size < 1:
            raise ValueError(f"RewardModelScorer.batch_size must be >= 1, got {batch_size}")
        self.name = name
        self.version = version or _folder_hash(Path(self.path))
        self.device = device
        self.batch_size = batch_size
        self._model: Any = None
        self._tokenizer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_model"] = state["_tokenizer"] = None  # each process loads its own copy
        return state

    def setup(self) -> None:
        if self._model is not None:
            return
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.path)
        tokenizer.padding_side = "right"
        model = AutoModelForSequenceClassification.from_pretrained(self.path).float()
        if model.config.num_labels != 1:
            raise ValueError(f"reward model {self.path} has num_labels={model.config.num_labels}, "
                             "expected 1")
        if tokenizer.pad_token_id is None or model.config.pad_token_id != tokenizer.pad_token_id:
            raise ValueError(f"reward model {self.path}: tokenizer pad id {tokenizer.pad_token_id} "
                             f"!= config.pad_token_id {model.config.pad_token_id}; "
                             "batched scoring needs both set and equal")
        self._model = model.to(self.device).eval()
        self._tokenizer = tokenizer

    def format(self, sample: RewardSample) -> str:
        """The RM's input text for a sample (its chat template, or plain concatenation)."""
        self.setup()
        if self._tokenizer.chat_template:
            messages = [{"role": "user", "content": sample.prompt},
                        {"role": "assistant", "content": sample.response}]
            return self._tokenizer.apply_chat_template(messages, tokenize=False)
        return sample.prompt + sample.response

    def score_batch(self, samples: Sequence[RewardSample]) -> list[float]:
        import torch

        self.setup()
        # A chat template renders its own special tokens; plain text gets the tokenizer's.
        add_special = not self._tokenizer.chat_template
        texts = [self.format(s) for s in samples]
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(texts[start:start + self.batch_size], padding=True,
                                        add_special_tokens=add_special, return_tensors="pt")
                batch = {k: v.to(self.device) for k, v in batch.items()
                         if k in ("input_ids", "attention_mask")}
                logits = self._model(**batch).logits  # (B, 1)
                scores.extend(logits[:, 0].float().cpu().tolist())
        return scores

    def __call__(self, sample: RewardSample) -> float:
        return self.score_batch([sample])[0]


def _folder_hash(folder: Path) -> str:
    h = hashlib.sha256()
    files = [folder / name for name in _VERSION_FILES] + sorted(folder.glob("*.safetensors"))
    for file in files:
        if file.is_file():
            h.update(file.name.encode())
            with open(file, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:12]
