"""Actor role: trainable weights, optimizer and learning-rate schedule; teacher-forced old
log-probs; the policy loss, backward and optimizer steps. It never samples."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from sealrl import algos, faults
from sealrl.experience import ExperienceBatch, PolicyVersion, Role
from sealrl.models import precision
from sealrl.models.hf import model_config_hash
from sealrl.models.lora import adapter_scaling, adapter_state, base_state, has_lora
from sealrl.models.packing import TeacherForcing
from sealrl.roles import common
from sealrl.roles.common import batch_log_probs, lr_at, optimizer_step, pad_width
from sealrl.roles.distributed import all_gather_cat, all_reduce_sums, idle_passes, own_rows, world
from sealrl.sync.adapter import AdapterManifest, build_adapter_manifest, copy_once, rollout_copy
from sealrl.sync.manifest import WeightManifest, build_manifest

if TYPE_CHECKING:
    from sealrl.config import ActorConfig, AlgorithmConfig


class RolloutMismatch(RuntimeError):
    """The training forward of the sampling policy and the rollout's log-probs of the same tokens
    differ past algorithm.mismatch_tol: a named stop, not an update to retry."""


class Actor:
    def __init__(self, model, cfg: ActorConfig, algo: AlgorithmConfig, run_id: str,
                 tokenizer_hash: str, temperature: float, pad_id: int, total_steps: int,
                 horizon: int, tf: TeacherForcing | None = None, exact: bool = True):
        """`tf`: how the teacher-forced passes run (roles/common.teacher_forcing; default the HF
        reference path); `exact` (run.exact): torch's default AdamW loop, else its fused kernel."""
        self.device = precision.resolve_device(cfg.device, "actor.device")
        self.model, self.cfg, self.algo = model.to(self.device), cfg, algo   # in place: moved, not copied
        self.run_id, self.tokenizer_hash = run_id, tokenizer_hash
        self.temperature, self.pad_id, self.total_steps, self.horizon = temperature, pad_id, total_steps, horizon
        self.config_hash = model_config_hash(model.config)
        # LoRA: the frozen base's manifest (pinned by the rollout, named by every version and checkpoint)
        self.base = build_manifest({k: v.detach().cpu() for k, v in base_state(model).items()}, "base", 0, 0,
                                   tokenizer_hash, self.config_hash) if has_lora(model) else None
        self.tf = tf or common.teacher_forcing(cfg)  # micro-batches, packing, logit chunks (models/packing.py)
        self.exact = exact
        common.set_gradient_checkpointing(model, cfg.gradient_checkpointing)
        self.optimizer = self.make_optimizer()
        self.step = 0           # committed optimizer steps
        self.attempt = 0        # tries of the current update (a rolled-back update retries)
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite gradient
        self.iteration = 0      # the iteration being updated (names fault-injection points)
        self.seed = 0           # the update's seed (Clip-Cov's token draw)
        self._kept = None       # (batch, version id, log-probs, entropy) of a fused old forward
        self._accumulated = None   # (batch, version id, totals, first, ratios) of a first step run there
        self._mismatch: dict[str, float] = {}   # the last update's logprob/current_vs_rollout_*
        self._has_dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) \
            or any(getattr(model.config, k, 0) for k in ("attention_dropout", "hidden_dropout", "dropout"))

    def make_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the model's trainable parameters (all of them, or with LoRA the adapter's);
        made again after FSDP2 replaces them with DTensors."""
        cfg = self.cfg
        params = [p for p in self.model.parameters() if p.requires_grad]
        return common.adamw(params, not self.exact, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay)

    # ---- versions and export ------------------------------------------------------------
    def export(self) -> tuple[dict[str, torch.Tensor], WeightManifest | AdapterManifest]:
        """EXPORTING(v): a detached CPU copy of the weights and their manifest; with LoRA only
        the adapter's tensors, and a manifest naming the base by hash (sync/adapter.py)."""
        state = copy_once(self.exported_tensors(), lambda t: t.detach().cpu().clone())   # tied: one copy
        return state, self.manifest_of(state)

    def exported_tensors(self) -> dict[str, torch.Tensor]:
        """What a version ships, no copies: the whole state dict, or with LoRA the adapter's factors."""
        return adapter_state(self.model) if self.base is not None else self.model.state_dict()

    def manifest_of(self, state: dict[str, torch.Tensor]) -> WeightManifest | AdapterManifest:
        """The manifest of an exported `state` at this actor's step and attempt."""
        if self.base is not None:
            return build_adapter_manifest(state, adapter_scaling(self.model), self.base.version.weights_hash,
                                          self.run_id, self.step, self.attempt, self.tokenizer_hash,
                                          self.config_hash)
        return build_manifest(state, self.run_id, self.step, self.attempt, self.tokenizer_hash, self.config_hash)

    def publish(self, dtype: str, base_hash: str | None) -> tuple[dict[str, torch.Tensor], WeightManifest]:
        """EXPORTING(v): what the rollout loads of the exported version and its manifest (in the
        rollout's `dtype`, or the adapter named on the base the rollout pinned: rollout_copy)."""
        return rollout_copy(*self.export(), dtype, base_hash)

    # ---- old log-probs ------------------------------------------------------------------
    def compute_old_log_probs(self, batch: ExperienceBatch, version: PolicyVersion,
                              fuse: tuple[int, int, float] | None = None) -> None:
        """Recompute mode: one actor forward on the sealed facts before any update. Written
        once into `old_log_probs` and never overwritten across epochs and minibatches.

        When the update will be exactly one optimizer step over the whole batch, that step's
        forward is this same forward (same weights, same rows, same order), so it runs once and
        the update reuses it instead of running it again; the numbers written are the same:
        - one micro-batch: the forward runs with gradients on and its graph is kept (`_kept`);
        - several (the fast path, given `fuse` = (iteration, seed, KL coefficient) because the
          advantages are derived already): the first step's forward and backward run here, a
          micro-batch at a time, each writing its old log-probs (`_accumulated`); the update
          then takes the optimizer step on the gradients, after the batch is sealed."""
        one_step = self._one_step(len(batch))
        if one_step and len(self._micro_batches(batch, torch.arange(len(batch)))) == 1:
            self.model.train()
            lp, ent = self._forward(batch, torch.arange(len(batch)))
            self._kept = (batch, version.id, lp, ent)
            batch.put("old_log_probs", lp.detach().masked_fill(~batch.token_mask(), 0.0), Role.ACTOR, version.id)
            return
        if one_step and fuse is not None and not self.exact and self.algo.correction == "none":
            self._first_step_here(batch, version, *fuse)
            return
        self.model.eval()
        with precision.compute(self.cfg.dtype, precision.model_device(self.model)):
            lp, _ = batch_log_probs(self.model, batch, self.temperature, self.pad_id, self.tf.micro_batch_size,
                                    tf=self.tf)
        batch.put("old_log_probs", lp, Role.ACTOR, version.id)

    def _first_step_here(self, batch: ExperienceBatch, version: PolicyVersion, iteration: int, seed: int,
                         kl_coef: float) -> None:
        """The forward and backward of the update's one step, old log-probs taken from it."""
        self.iteration, self.seed = iteration, seed
        old = torch.zeros(len(batch), batch.num_response_tokens)   # each micro-batch writes its rows
        _, mask = loss_mask(batch, self.algo)
        ratios, first = [torch.zeros(0)], []
        self.model.train()
        try:
            totals = self._accumulate(batch, torch.arange(len(batch)), old, batch.get("advantages"), mask,
                                      self._kl(batch, kl_coef), None, ratios, first=first, fill_old=True)
        finally:
            self.model.eval()
        batch.put("old_log_probs", old.masked_fill(~batch.token_mask(), 0.0), Role.ACTOR, version.id)
        self._accumulated = (batch, version.id, totals, first, ratios)

    def _one_step(self, b: int) -> bool:
        """One process, one epoch, one minibatch, nothing stochastic in the forward."""
        cfg = self.cfg
        return (world()[1] == 1 and cfg.ppo_epochs == 1 and (not cfg.mini_batch_size or cfg.mini_batch_size >= b)
                and not self._has_dropout)

    def _kl(self, batch: ExperienceBatch, kl_coef: float):
        """(reference log-probs, coefficient) of the KL-in-loss term, or None."""
        return (batch.get("ref_log_probs"), kl_coef) if kl_coef > 0 and self.algo.kl_in == "loss" else None

    def _forward(self, batch: ExperienceBatch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced log-probs and entropy of `rows`, (len(rows), R), gradients flowing, on
        the CPU (the loss is on (B, R) tensors beside the batch's; a no-op on a CPU actor)."""
        samples = [batch.samples[i] for i in rows.tolist()]
        with precision.compute(self.cfg.dtype, precision.model_device(self.model)):
            lp, ent, _ = self.tf.log_probs(self.model, [list(s.prompt_ids) for s in samples],
                                           [list(s.response_ids) for s in samples], self.temperature, self.pad_id,
                                           with_entropy=True)
        width = batch.num_response_tokens
        return pad_width(lp, width).cpu(), pad_width(ent, width).cpu()

    def _micro_batches(self, batch: ExperienceBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        """`rows` split into micro-batches: by count (consecutive), or by the token budget."""
        return [torch.tensor(p, dtype=torch.long) for p in common.micro_batches(self.tf, rows.tolist(), batch.samples)]

    # ---- rollback -----------------------------------------------------------------------
    def snapshot(self, copy: bool = True) -> dict:
        return common.snapshot(self, copy)

    def restore(self, snap: dict) -> None:
        common.restore(self, snap)
        self._kept = self._accumulated = None  # they saw the weights before they were loaded again

    def set_counters(self, **counters: int) -> None:
        """Restoring a checkpoint (position.py): step and the other counters."""
        vars(self).update(counters)

    # ---- update -------------------------------------------------------------------------
    def update(self, batch: ExperienceBatch, version: PolicyVersion, iteration: int, seed: int,
               kl_coef: float) -> dict:
        """UPDATING_FROM(v): minibatch optimizer steps over `ppo_epochs` passes. `kl_coef` is the
        KL-in-loss coefficient in force: the driver's KL controller's beta (the one `kl/beta` logs)."""
        cfg, algo = self.cfg, self.algo
        self.iteration, self.seed = iteration, seed
        old = batch.get("old_log_probs", version=version.id)
        adv = batch.get("advantages")
        candidates, mask = loss_mask(batch, algo)
        weights = self._is_weights(batch, old)
        kl = self._kl(batch, kl_coef)
        b = len(batch)
        mini = cfg.mini_batch_size or b
        gen = torch.Generator().manual_seed(seed)
        sums: dict[str, list[float]] = {}
        ratios = [torch.zeros(0)]  # this rank's ratios at its loss-mask tokens, every step
        kept, self._kept = self._kept, None  # used by this update's first try only
        if kept is not None and (kept[0] is not batch or kept[1] != version.id):
            kept = None
        done, self._accumulated = self._accumulated, None   # the first step's backward, run already
        if done is not None and (done[0] is not batch or done[1] != version.id):
            done = None
        self.model.train()
        try:
            for epoch in range(cfg.ppo_epochs):
                order = torch.randperm(b, generator=gen) if (cfg.ppo_epochs > 1 or mini < b) else torch.arange(b)
                for start in range(0, b, mini):
                    idx = order[start:start + mini]
                    # the first step's forward is the policy that sampled (before any update): the
                    # train-vs-rollout mismatch is measured there, in every old_log_prob mode
                    first = [] if epoch == 0 and start == 0 else None
                    if done is not None:   # compute_old_log_probs ran this step's micro-batches
                        stats = self._step(done[2], done[3])
                        ratios.extend(done[4])
                    else:
                        stats = self._optimizer_step(batch, idx, old, adv, mask, kl, weights, ratios,
                                                     kept=None if kept is None else kept[2:], first=first)
                    for k, v in stats.items():
                        sums.setdefault(k, []).append(v)
        finally:
            self.model.eval()
        out = {f"actor/{k}": sum(v) / len(v) for k, v in sums.items()}
        out.update(self._mismatch)
        out["actor/skipped_steps"] = float(self.skipped_steps)
        out["actor/reused_old_forward"] = float(kept is not None or done is not None)   # the old pass was this forward
        out["actor/first_step_in_old_pass"] = float(done is not None)   # and its backward ran there too
        if cfg.loss != "pg":
            # Quantiles and extremes do not add up over ranks: gather the values (exact).
            out.update({f"actor/{k}": float(v) for k, v in
                        algos.ratio_stats(all_gather_cat(torch.cat(ratios))).items()})
        if algo.correction != "none":
            after_rejection = mask if algo.correction.endswith("_reject") else None
            out.update({f"correction/{k}": float(v) for k, v in
                        algos.correction_metrics(candidates, after_rejection, weights).items()})
        return out

    def _check_mismatch(self, diff: torch.Tensor) -> dict[str, float]:
        """logprob/current_vs_rollout_*: current - rollout log-prob at the first step's action
        tokens (every rank's, gathered); RolloutMismatch past algorithm.mismatch_tol."""
        x = diff.float().clamp(-20.0, 20.0)
        worst = float(x.abs().max()) if len(x) else 0.0
        out = {"logprob/current_vs_rollout_k1": float(-x.mean()) if len(x) else 0.0,
               "logprob/current_vs_rollout_k3": float((x.exp() - 1 - x).mean()) if len(x) else 0.0,
               "logprob/current_vs_rollout_abs_diff_max": worst,
               "logprob/current_vs_rollout_abs_diff_mean": float(x.abs().mean()) if len(x) else 0.0,
               "logprob/current_vs_rollout_tokens": float(len(x))}
        tol = self.algo.mismatch_tol   # with drop_group the groups past it were dropped before the seal
        if tol and worst > tol and self.algo.mismatch_action == "stop":
            raise RolloutMismatch(f"iteration {self.iteration}: the training forward and the rollout disagree by "
                                  f"{worst:.3g} nats on a sampled token (algorithm.mismatch_tol={tol:g}; k1 "
                                  f"{out['logprob/current_vs_rollout_k1']:.3g} over {len(x)} tokens)")
        return out

    def _optimizer_step(self, batch, idx, old, adv, mask, kl, weights, ratios, kept=None,
                        first: list | None = None) -> dict[str, float]:
        """One optimizer step over minibatch `idx`. kl: (reference log-probs, coefficient) of
        the KL-in-loss term, or None; the ratios at this rank's loss-mask tokens go to `ratios`.
        `first` (the update's first step): collects current - rollout log-probs at the action
        tokens, measured (and held to algorithm.mismatch_tol) before the optimizer steps."""
        totals = self._accumulate(batch, idx, old, adv, mask, kl, weights, ratios, kept, first)
        return self._step(totals, first)

    def _accumulate(self, batch, idx, old, adv, mask, kl, weights, ratios, kept=None, first: list | None = None,
                    fill_old: bool = False) -> dict[str, float]:
        """The forward and backward passes of one step, gradients accumulated over its
        micro-batches; returns the metric totals. `fill_old`: each micro-batch's log-probs are
        its old log-probs (written into `old`: the step's forward is the old log-prob pass)."""
        cfg, algo = self.cfg, self.algo
        # Every data-parallel rank holds the whole batch: this normaliser is the global one.
        norm = algos.make_normaliser(mask[idx], cfg.loss_agg, horizon=self.horizon)
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        rows = own_rows(batch, idx)  # this rank's rows by sample id; all of idx on one process
        for mi in self._micro_batches(batch, rows):
            # the fused old-log-prob forward covers exactly these rows (see compute_old_log_probs)
            lp, ent = kept if kept is not None else self._forward(batch, mi)
            if fill_old:
                old[mi] = lp.detach()
            m = mask[mi]
            if first is not None:
                action = batch.get("response_mask")[mi]
                first.append((lp.detach() - batch.get("rollout_log_probs")[mi])[action])
            loss, metrics = self._policy_loss(lp, old[mi], adv[mi], m, norm,
                                              None if weights is None else weights[mi])
            metrics.pop("ratio_max", None)  # a max is no share of a sum: exact, over every step, in update
            if cfg.loss != "pg":
                ratios.append(algos.policy_ratio(lp, old[mi], m, level="sequence" if cfg.loss == "gspo" else "token"))
            if kl is not None:
                kl_loss = algos.aggregate(algos.kl_penalty(lp, kl[0][mi], algo.kl_estimator), m, norm)
                loss = loss + kl[1] * kl_loss
                # a share of the global normaliser already, like pg_loss: it adds up (no token share)
                totals["kl_loss"] = totals.get("kl_loss", 0.0) + float(kl_loss.detach())
            ent_term = algos.aggregate(ent, m, norm)
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * ent_term
            loss.backward()
            # Per-micro-batch terms are already shares of the global normaliser: they add up.
            totals["pg_loss"] = totals.get("pg_loss", 0.0) + float(loss.detach())
            totals["entropy"] = totals.get("entropy", 0.0) + float(ent_term.detach())
            share = float(m.sum()) / max(1.0, float(mask[idx].sum()))
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v) * share
        # FSDP2: as many passes as the rank with the most rows (collectives); these add nothing
        for _ in range(idle_passes(self.model, [batch.samples[i].sample_id for i in idx.tolist()],
                                   common.pass_counter(self.tf, batch.samples))):
            (self._forward(batch, idx[:1])[0].sum() * 0.0).backward()
        return totals

    def _step(self, totals: dict[str, float], first: list | None) -> dict[str, float]:
        """The optimizer step on the accumulated gradients: the mismatch check of the update's
        first step, metric and gradient sums over data-parallel ranks, clip, step."""
        cfg = self.cfg
        if first is not None:
            self._mismatch = self._check_mismatch(all_gather_cat(torch.cat(first) if first else torch.zeros(0)))
        # Data-parallel (no-ops on one process): the ranks' losses are shares of one loss, so
        # gradients and metric shares are SUMMED; clip and step then match on every rank.
        totals = all_reduce_sums(totals)
        lr = lr_at(self.step, cfg.lr, cfg.warmup_steps, cfg.lr_schedule, self.total_steps, cfg.min_lr_ratio)
        totals["grad_norm"] = optimizer_step(self.model, self.optimizer, cfg.grad_clip, lr,
                                             lambda: faults.point("before_optimizer_step", self.iteration))
        if math.isfinite(totals["grad_norm"]):
            self.step += 1
            totals["lr"] = lr
        else:
            self.skipped_steps += 1
        return totals

    def _policy_loss(self, lp, old, adv, mask, norm, weights):
        cfg = self.cfg
        if cfg.loss == "clip":
            return algos.ppo_clip_loss(lp, old, adv, mask, norm, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                       dual_clip=cfg.dual_clip or None, is_weights=weights)
        if cfg.loss in ("gspo", "cispo", "gmpo"):
            return algos.POLICY_LOSSES[cfg.loss](lp, old, adv, mask, norm, clip_low=cfg.clip_low,
                                                 clip_high=cfg.clip_high, is_weights=weights)
        if cfg.loss != "pg":
            return algos.POLICY_LOSSES[cfg.loss](lp, old, adv, mask, norm, is_weights=weights, **self._loss_params())
        return algos.policy_gradient_loss(lp, adv, mask, norm, is_weights=weights)

    def _loss_params(self) -> dict:
        """Keyword arguments of the sapo, clip_cov and kl_cov losses from the actor config. Clip-Cov
        draws its tokens from a generator seeded by (run seed, optimizer step, attempt): the same
        draw in a repeated or resumed run."""
        cfg = self.cfg
        if cfg.loss == "sapo":
            return {"tau_pos": cfg.sapo_tau_pos, "tau_neg": cfg.sapo_tau_neg}
        if cfg.loss == "kl_cov":
            return {"cov_ratio": cfg.cov_ratio, "kl_coef": cfg.kl_cov_coef}
        gen = torch.Generator().manual_seed(self.seed * 1000003 + self.step * 101 + self.attempt)
        return {"clip_low": cfg.clip_low, "clip_high": cfg.clip_high, "cov_ratio": cfg.cov_ratio,
                "cov_lb": cfg.clip_cov_bounds[0], "cov_ub": cfg.clip_cov_bounds[1], "generator": gen}

    def _is_weights(self, batch: ExperienceBatch, old: torch.Tensor) -> torch.Tensor | None:
        """Truncated importance weights old/rollout (train/inference mismatch correction)."""
        if not self.algo.correction.endswith("_is"):
            return None
        level = self.algo.correction.split("_")[0].replace("seq", "sequence")
        return algos.importance_weights(old, batch.get("rollout_log_probs"), batch.get("response_mask"),
                                        level=level, cap=self.algo.correction_threshold)


def loss_mask(batch: ExperienceBatch, algo: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidates, mask), (B, T) bool. candidates: the action tokens that may take part in the
    loss, the response mask minus truncated responses (overlong=mask); mask: those that do,
    the candidates minus tokens / sequences rejected by rollout correction (*_reject)."""
    candidates = batch.get("response_mask").clone()
    if algo.overlong == "mask":
        truncated = torch.tensor([s.stop_reason.truncated for s in batch.samples])
        candidates &= ~truncated[:, None]
    if not algo.correction.endswith("_reject"):
        return candidates, candidates
    level = algo.correction.split("_")[0].replace("seq", "sequence")
    keep = algos.rejection_mask(batch.get("old_log_probs"), batch.get("rollout_log_probs"), candidates,
                                level=level, kind="k3", threshold=algo.correction_threshold)
    return candidates, candidates & keep
