"""`reward.stream`: score each sample as soon as the rollout finishes it, while other rows still
decode, instead of scoring the iteration once all of it is generated.

What it consumes: the samples the rollout hands on after every decode step (RolloutEngine.generate
`stream`; an episode's sample once it ended), for the first generate call and its retries. What
it guarantees: the iteration's records are those of the unstreamed path, bitwise, whatever order
the samples finished and were scored in. Scoring order cannot leak into anything sealed because
nothing streamed is delivered to the ledger early: `take` is called by the scoring stage in the
same place, with the same sample ids in the same order, as the unstreamed scoring call, and
the ledger is then told the same things in the same order (collect._score_once). A streamed
record is used only for a sample equal to the one delivered (same ids, tokens, log-probs,
version, seed: a retry that regenerated another sample under that id is scored again, as are
samples never streamed, e.g. episodes ended by the turn budget). Reward errors and timeouts are
records as before; the stream itself failing (the pool broke) only stops streaming: every
sample is then scored by the usual call, which reports that failure as today.

What it waits for: nothing while generation runs (the pool is only polled, between decode
steps); `take` waits for the samples still being scored. Only scorer processes stream
(reward.num_scorers >= 1, checked by config/loading.check_config); inline and batch scorers
score everything in `take`, as the unstreamed call would.
"""
from __future__ import annotations

from contextlib import contextmanager

from sealrl.experience.records import RewardRecord, StopReason
from sealrl.experience.wire import RolloutSample
from sealrl.trainer.collect import reward_item


class EarlyScores:
    """The reward stream of one iteration's generation (see the module docstring)."""

    def __init__(self, run, prompt_of) -> None:
        self._decode = run.roles.tokenizer.decode
        self._prompt_of = prompt_of            # group id -> prompt
        self._stream = run.roles.reward.stream()
        self._items: dict[str, tuple] = {}     # sample id -> the reward item streamed
        self._records: dict[str, RewardRecord] | None = None
        self.failure: str | None = None        # why streaming stopped, if it did

    def add(self, samples: list[RolloutSample]) -> None:
        """Called by the rollout after every decode step: hand on the samples that finished
        (the first one seen per sample id; failed samples are never scored)."""
        if self.failure is not None:
            return
        new = []
        for s in samples:
            if s.sample_id in self._items or s.stop_reason is StopReason.ERROR:
                continue
            text = self._decode(list(s.response_ids), skip_special_tokens=True)
            self._items[s.sample_id] = item = reward_item(s, self._prompt_of(s.group_id), text)
            new.append(item)
        try:
            self._stream.add(new)
        except Exception as e:  # noqa: BLE001 - not the rollout's failure: stop streaming, score later
            self.failure = f"{type(e).__name__}: {e}"

    def take(self, ids: list[str], items: dict[str, tuple]) -> tuple[list[tuple[str, RewardRecord]], list[str]]:
        """Wait for the stream; ((sample id, record) of each of `ids` streamed as `items` has
        it, in `ids` order), and the ids still to score."""
        self._finish()
        done = {i for i in ids if self._records and i in self._items and self._items[i][:3] == items[i][:3]}
        return [(i, self._records[i]) for i in ids if i in done], [i for i in ids if i not in done]

    def _finish(self) -> None:
        if self._records is None:
            try:
                self._records = {} if self.failure is not None else self._stream.finish()
            except Exception as e:  # noqa: BLE001 - as in add
                self.failure, self._records = f"{type(e).__name__}: {e}", {}


@contextmanager
def early_scores(run, prompt_of):
    """An EarlyScores when reward.stream is on, else None; drained however the stage ends (a
    stream left open would hold the pool's workers)."""
    early = EarlyScores(run, prompt_of) if run.cfg.reward.stream else None
    try:
        yield early
    finally:
        if early is not None:
            early._finish()
