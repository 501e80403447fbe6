"""Load and save Hugging Face causal LMs, and fingerprint what must agree between roles.

Every role that sees token ids (rollout, actor, reference, critic, reward) must share one
tokenizer, and every role that loads weights of a version must share one architecture. The
hashes here are what PolicyVersion carries (`tokenizer_hash`, `model_config_hash`), so a
mismatch is an error at load time instead of silently wrong log-probs later.

Loading is local-only (no hub access) and safetensors-only (no pickle: a checkpoint may come
from elsewhere). Saving writes the ordinary `save_pretrained` layout, so transformers, vLLM and
sealrl all load the same folder.
"""
from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel
from transformers.utils import logging as hf_logging

from sealrl.config import MissingInputError, UserError

# Config keys that describe how a model was saved or run, not what it computes: a bf16 copy
# of the same architecture, or the same folder moved elsewhere, has the same config hash.
_RUNTIME_CONFIG_KEYS = frozenset({
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "_attn_implementation",
    "_attn_implementation_autoset", "architectures",
})


def quiet(fn):
    """Run `fn` without transformers' progress bars ("Loading weights", "Writing model shards"):
    a run loads and saves folders at every checkpoint, and sealrl reports its own progress."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                hf_logging.enable_progress_bar()
    return wrapper


class TokenizerMismatchError(UserError, ValueError):
    """Two roles would read the same token ids as different text."""


@quiet
def load_causal_lm(path: str | Path, trust_remote_code: bool = False,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model in eval mode, tokenizer) from a local HF folder; safetensors weights only."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise MissingInputError(f"load_causal_lm: {folder} is not a Hugging Face model folder "
                                f"(no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                              trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype,
                                                 use_safetensors=True,
                                                 trust_remote_code=trust_remote_code)
    return model.to(device).eval(), tokenizer


def padding_id(tokenizer, folder: str | Path) -> int:
    """The id that fills padded positions: the tokenizer's pad token, else its eos (many
    instruct folders define no pad token). Padded positions are masked everywhere, so only
    a valid id is needed; a tokenizer with neither is an error naming the folder."""
    for name in ("pad_token_id", "eos_token_id"):
        if (i := getattr(tokenizer, name)) is not None:
            return int(i)
    raise UserError(f"{folder}: the tokenizer has neither a pad nor an eos token; sealrl needs an "
                    f"eos token to end responses (set eos_token in tokenizer_config.json)")


@quiet
def save_causal_lm(model: PreTrainedModel, tokenizer, path: str | Path) -> Path:
    """Write model (safetensors) + tokenizer in the `save_pretrained` layout; returns the folder.

    transformers 5 always writes safetensors (the `safe_serialization` switch is gone); the
    assertion keeps that promise checked should a future version change the default.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if not any(folder.glob("*.safetensors")):
        raise RuntimeError(f"save_causal_lm: no safetensors file written to {folder}")
    return folder


@quiet
def save_causal_lm_shards(model: PreTrainedModel, shards: Iterable[dict[str, torch.Tensor]], tokenizer,
                          path: str | Path) -> Path:
    """save_causal_lm for a model whose weights are not in this process (a data-parallel group's
    mirror, on the meta device): the config, generation config and tokenizer from `model` and
    `tokenizer`, the weights from `shards` ({name: tensor} each, full tensors, one shard in memory
    at a time), written as they come as model-00001.safetensors, ... with the index
    (`model.safetensors.index.json`) that transformers and vLLM read. Tied aliases are left out,
    as save_pretrained leaves them out."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    aliases = tied_aliases(model)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        kept = {k: v.detach().cpu().contiguous() for k, v in shard.items() if k not in aliases}
        name = f"model-{i:05d}.safetensors"
        save_file(kept, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(kept, name))
        total += sum(v.numel() * v.element_size() for v in kept.values())
    if not weight_map:
        raise RuntimeError(f"save_causal_lm_shards: no weights came for {folder}")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """State-dict names of parameters that are another, earlier named parameter (a tied output
    head: `lm_head.weight` when it is the input embedding)."""
    seen: set[int] = set()
    aliases = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return aliases


def _sha256_json(obj: object) -> str:
    text = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """sha256 over what decides token ids and how they read: vocab, special tokens, chat
    template, and the fast tokenizer's pipeline (normaliser, pre-tokenizer, merges)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # slow tokenizers have none
    pipeline = json.loads(backend.to_str()) if backend is not None else None
    if pipeline is not None:
        pipeline.pop("version", None)
    return _sha256_json({
        "vocab": tokenizer.get_vocab(),
        "special_tokens": {name: str(tok) for name, tok in tokenizer.special_tokens_map.items()},
        "added_tokens": {i: str(tok) for i, tok in tokenizer.added_tokens_decoder.items()},
        "chat_template": tokenizer.chat_template,
        "pipeline": pipeline,
    })


def model_config_hash(config: PretrainedConfig) -> str:
    """sha256 of the architecture-defining config fields (runtime/dtype keys excluded)."""
    fields = {k: v for k, v in config.to_dict().items() if k not in _RUNTIME_CONFIG_KEYS}
    return _sha256_json(fields)


def check_same_tokenizer(a_hash: str, b_hash: str, who: str) -> None:
    """Raise TokenizerMismatchError when two tokenizer hashes differ; `who` names the pair."""
    if a_hash != b_hash:
        raise TokenizerMismatchError(
            f"{who}: tokenizer mismatch ({a_hash[:12]} != {b_hash[:12]}); the same token ids "
            f"would mean different text. Load both roles from the same tokenizer folder.")
