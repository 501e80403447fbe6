"""A resumable stream of prompt-index batches, epoch after epoch.

Its whole position is three integers (seed, epoch, cursor), so it checkpoints as JSON and a
restored sampler continues with exactly the batches the uninterrupted one would have produced
(DESIGN section 6: the prompt-sampler cursor is part of the training position).

A batch never crosses an epoch boundary, so an index appears at most once per batch: group
ids are `run/iter/prompt`, and a prompt twice in one iteration would collide.
"""
from __future__ import annotations

import random
from typing import Iterator

_STATE_VERSION = 1


def epoch_permutation(num_prompts: int, seed: int, epoch: int) -> list[int]:
    """Fisher-Yates driven by `random.Random(str).random()`.

    Python guarantees that stream (string seeding and `random()`) across versions, unlike
    `shuffle`/`randbelow` or numpy's Generator methods, so a checkpoint resumes to the same
    order after an upgrade. The float-to-index step has a bias below 2**-40, irrelevant here.
    """
    rng = random.Random(f"sealrl-sampler:{seed}:{epoch}")
    order = list(range(num_prompts))
    for i in range(num_prompts - 1, 0, -1):
        j = int(rng.random() * (i + 1))
        order[i], order[j] = order[j], order[i]
    return order


class PromptSampler:
    """Yields lists of prompt indices forever; reshuffled each epoch with a seed from
    (seed, epoch).

    With `drop_last`, every batch has exactly `batch_size` indices and the epoch's remainder is
    skipped (a different remainder each epoch when shuffling); without it the last batch of an
    epoch is short. Iterating advances the position; `state_dict()` taken between batches
    resumes at the next batch.
    """

    def __init__(self, num_prompts: int, batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False) -> None:
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > num_prompts:
            raise ValueError(f"drop_last with batch_size={batch_size} > num_prompts="
                             f"{num_prompts} would never yield a batch")
        self.num_prompts, self.batch_size = num_prompts, batch_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch, self.cursor = 0, 0
        self._order: list[int] | None = None  # cache of the current epoch's order

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            self._order = (epoch_permutation(self.num_prompts, self.seed, self.epoch)
                           if self.shuffle else list(range(self.num_prompts)))
        return self._order

    def next_batch(self) -> list[int]:
        """The next batch; moves to a new epoch when the current one is used up."""
        remaining = self.num_prompts - self.cursor
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
        batch = self._epoch_order()[self.cursor:self.cursor + self.batch_size]
        self.cursor += len(batch)
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """JSON-able position plus the settings it is only meaningful with."""
        return {"version": _STATE_VERSION, "seed": self.seed, "epoch": self.epoch,
                "cursor": self.cursor, "num_prompts": self.num_prompts,
                "batch_size": self.batch_size, "shuffle": self.shuffle,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position. Settings must match the constructor's: resuming a run whose
        dataset size or batch size changed would silently replay or skip prompts."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')!r} is not "
                             f"{_STATE_VERSION}")
        for key in ("seed", "num_prompts", "batch_size", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler was "
                                 f"built with {key}={getattr(self, key)!r}")
        epoch, cursor = state["epoch"], state["cursor"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(cursor, int)
                and 0 <= cursor <= self.num_prompts):
            raise ValueError(f"sampler state has invalid position epoch={epoch!r}, "
                             f"cursor={cursor!r} for num_prompts={self.num_prompts}")
        self.epoch, self.cursor, self._order = epoch, cursor, None
