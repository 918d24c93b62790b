"""GRPO: group-normalised advantages and a PPO-style clipped surrogate against the actors' logprobs.

Each prompt is sampled ``G`` times; a sample's advantage is its reward minus the group mean, over the
group std. The importance ratio compares the trainer's current policy with the logprobs the actor
reported for the tokens it sampled, so samples generated one version behind (one-step asynchrony)
are corrected and clipped. An optional KL penalty to a frozen reference uses the k3 estimator
``exp(ref - logp) - (ref - logp) - 1``. Master weights stay FP32 under AdamW with gradient clipping.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NoReturn, Protocol

from pydantic import BaseModel, ConfigDict, Field

from deltarl.errors import NonFiniteStep
from deltarl.model.build import export_bf16
from deltarl.trainer.logprobs import completion_logprobs

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class SampleLike(Protocol):
    """What GRPO reads of one rollout sample (``deltarl.protocol.records.Sample`` fits)."""

    prompt_id: str
    prompt_token_ids: Sequence[int]
    completion_token_ids: Sequence[int]
    completion_text: str
    logprobs: Sequence[float]
    reward: float


class ResultLike(Protocol):
    """What GRPO reads of one admitted result (``deltarl.protocol.records.RolloutResult`` fits)."""

    @property
    def samples(self) -> Sequence[Any]: ...


class GRPOConfig(BaseModel):
    """Optimisation settings of GRPO."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(default=1e-6, gt=0, le=1.0, description="AdamW learning rate (1e-6 for real models)")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas")
    weight_decay: float = Field(default=0.0, ge=0, le=1.0, description="AdamW decoupled weight decay")
    adam_eps: float = Field(default=1e-8, gt=0, le=1e-2, description="AdamW epsilon")
    grad_clip: float = Field(default=1.0, gt=0, description="clip the global gradient norm to this")
    clip_eps_low: float = Field(default=0.2, ge=0, le=1.0, description="PPO clip: ratio >= 1 - eps_low")
    clip_eps_high: float = Field(default=0.2, ge=0, le=10.0, description="PPO clip: ratio <= 1 + eps_high")
    kl_coef: float = Field(default=0.0, ge=0, description="weight of the k3 KL penalty to the reference (0 = none)")
    temperature: float = Field(default=1.0, ge=0, le=10.0, description="sampling temperature the logprobs refer to")
    micro_batch: int = Field(default=64, ge=1, le=65536, description="samples per forward/backward (gradient accumulation)")
    loss_agg: Literal["token", "sequence"] = Field(default="token", description="'token': mean over all tokens of the batch; 'sequence': mean of per-sequence means"
    )
    adv_eps: float = Field(default=1e-4, gt=0, description="added to the group std when normalising advantages")
    lr_warmup_steps: int = Field(default=0, ge=0, le=10**6, description="ramp the lr linearly over the first this many steps (step k uses lr * k / (n + 1))")


@dataclass(frozen=True)
class TrainStats:
    """What one optimiser step did."""

    step: int
    loss: float
    reward_mean: float
    reward_std: float
    kl: float
    clip_frac: float
    ratio_mean: float
    grad_norm: float
    samples: int
    tokens: int
    groups: int
    seconds: float


def group_advantages(rewards: Sequence[float], group_ids: Sequence[str], *, eps: float = 1e-4) -> list[float]:
    """``(r - mean_g) / (std_g + eps)`` per sample, with mean and (population) std over its group."""
    if len(rewards) != len(group_ids):
        raise ValueError("one group id per reward")
    groups: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    adv = [0.0] * len(rewards)
    for idx in groups.values():
        vals = [float(rewards[i]) for i in idx]
        mean = sum(vals) / len(vals)
        std = (sum((v - mean) ** 2 for v in vals) / len(vals)) ** 0.5
        for i in idx:
            adv[i] = (float(rewards[i]) - mean) / (std + eps)
    return adv


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, *, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` with ``r = exp(logp - old_logp)``.

    ``adv`` broadcasts against ``logp`` (``[B, 1]`` per sequence). Returns ``(loss, ratio, clipped)``
    where ``clipped`` is 1 where the clipped term was the one taken (its gradient is zero).
    """
    import torch

    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped_term = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped_term)
    was_clipped = (clipped_term < unclipped).float()
    return loss, ratio, was_clipped


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(pi || ref) per token: ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    import torch

    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


class GRPOTrainer:
    """One GRPO optimiser step per call of :meth:`train_step`, on FP32 master weights."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: GRPOConfig,
        *,
        pad_token_id: int,
        ref_model: torch.nn.Module | None = None,
        reward_fn: Callable[[Any], float] | None = None,
    ) -> None:
        """``model`` is trained in place (cast to FP32); ``reward_fn(sample)``, when given, recomputes
        each sample's reward instead of trusting the one the actor reported."""
        import torch

        self.model = model.to(dtype=torch.float32)
        self.config = config
        self.pad_token_id = pad_token_id
        self.ref_model = ref_model.eval() if ref_model is not None else None
        if config.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        self.reward_fn = reward_fn
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.steps_done = 0

    def lr_at(self, step: int) -> float:
        """The learning rate of optimiser step ``step`` (1-based): ``lr`` after the linear warm-up."""
        n = self.config.lr_warmup_steps
        return self.config.lr * min(1.0, step / (n + 1))

    def load_moments(self, moments: dict[str, dict[str, torch.Tensor]], *, which: str = "both") -> int:
        """Start AdamW from moments of an earlier optimiser (a warm-up), by parameter name.

        ``which``: ``"both"`` (``exp_avg``, ``exp_avg_sq`` and the step count) or ``"second"`` (the
        squared-gradient average and the step count; the first moment starts at zero, so the first
        updates start small instead of moving every weight by the full lr). Returns how many
        parameters got state; a name missing from ``moments`` keeps a fresh state.
        """
        import torch

        if which not in ("both", "second"):
            raise ValueError(f"which must be 'both' or 'second', not {which!r}")
        loaded = 0
        for name, p in self.model.named_parameters():
            src = moments.get(name)
            if src is None or not p.requires_grad:
                continue
            sq = src["exp_avg_sq"].to(device=p.device, dtype=p.dtype)
            if sq.shape != p.shape:
                raise ValueError(f"{name}: moment shape {tuple(sq.shape)} != parameter's {tuple(p.shape)}")
            avg = src["exp_avg"].to(device=p.device, dtype=p.dtype) if which == "both" else torch.zeros_like(p)
            self.optimizer.state[p] = {"step": src["step"].detach().clone().float().cpu(), "exp_avg": avg.clone(),
                                       "exp_avg_sq": sq.clone()}
            loaded += 1
        return loaded

    def export_bf16(self) -> dict[str, torch.Tensor]:
        """The BF16 inference state to publish (see :func:`deltarl.model.build.export_bf16`)."""
        return export_bf16(self.model)

    def _refuse(self, why: str, **what: Any) -> NoReturn:
        """Drop the accumulated gradients and raise: the weights and optimiser state stay unchanged."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        log.error("grpo step %d skipped, weights unchanged: %s (%s)", self.steps_done + 1, why, what)
        raise NonFiniteStep(f"step {self.steps_done + 1} not applied, weights unchanged: {why} ({what})")

    def train_step(self, results: Sequence[ResultLike]) -> TrainStats:
        """Train on every sample of ``results`` (one optimiser step) and return its statistics.

        A non-finite reward, loss or gradient norm raises ``NonFiniteStep`` before the optimiser
        steps: the weights are unchanged, the step is logged as skipped."""
        import torch

        cfg = self.config
        t0 = time.perf_counter()
        samples = [s for r in results for s in r.samples if len(s.completion_token_ids) > 0]
        if not samples:
            raise ValueError("train_step needs at least one sample with a non-empty completion")
        rewards = [float(self.reward_fn(s)) if self.reward_fn else float(s.reward) for s in samples]
        if not all(math.isfinite(r) for r in rewards):
            self._refuse("a reward is not finite", rewards=[r for r in rewards if not math.isfinite(r)][:4])
        adv = group_advantages(rewards, [s.prompt_id for s in samples], eps=cfg.adv_eps)
        n_tokens = sum(len(s.completion_token_ids) for s in samples)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        tot_loss = tot_kl = tot_clip = tot_ratio = 0.0
        for lo in range(0, len(samples), cfg.micro_batch):
            mb = samples[lo : lo + cfg.micro_batch]
            prompts = [list(s.prompt_token_ids) for s in mb]
            comps = [list(s.completion_token_ids) for s in mb]
            logp, mask = completion_logprobs(
                self.model, prompts, comps, temperature=cfg.temperature, pad_token_id=self.pad_token_id
            )
            old = torch.zeros_like(logp)
            for i, s in enumerate(mb):
                if len(s.logprobs) != len(s.completion_token_ids):
                    raise ValueError(f"sample of prompt {s.prompt_id!r}: one logprob per completion token")
                old[i, : len(s.logprobs)] = torch.tensor([float(x) for x in s.logprobs])
            a = torch.tensor(adv[lo : lo + len(mb)], device=logp.device)[:, None]
            per_tok, ratio, clipped = clipped_surrogate(
                logp, old, a, eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high
            )
            kl = torch.zeros_like(per_tok)
            if self.ref_model is not None:
                with torch.no_grad():
                    ref, _ = completion_logprobs(
                        self.ref_model, prompts, comps, temperature=cfg.temperature, pad_token_id=self.pad_token_id
                    )
                kl = k3_kl(logp, ref.to(logp.dtype))
                per_tok = per_tok + cfg.kl_coef * kl
            if cfg.loss_agg == "token":
                loss = (per_tok * mask).sum() / n_tokens
            else:
                loss = ((per_tok * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / len(samples)
            loss.backward()
            tot_loss += float(loss.detach())
            tot_kl += float((kl.detach() * mask).sum())
            tot_clip += float((clipped * mask).sum())
            tot_ratio += float((ratio.detach() * mask).sum())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
        if not (math.isfinite(tot_loss) and math.isfinite(grad_norm)):
            self._refuse("the loss or the gradient is not finite", loss=tot_loss, grad_norm=grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.steps_done + 1)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        self.steps_done += 1
        mean_r = sum(rewards) / len(rewards)
        stats = TrainStats(
            step=self.steps_done,
            loss=tot_loss,
            reward_mean=mean_r,
            reward_std=(sum((r - mean_r) ** 2 for r in rewards) / len(rewards)) ** 0.5,
            kl=tot_kl / n_tokens,
            clip_frac=tot_clip / n_tokens,
            ratio_mean=tot_ratio / n_tokens,
            grad_norm=grad_norm,
            samples=len(samples),
            tokens=n_tokens,
            groups=len({s.prompt_id for s in samples}),
            seconds=time.perf_counter() - t0,
        )
        log.info(
            "grpo step %d: reward %.3f loss %.4f kl %.4f clip %.3f grad %.3f (%d samples, %.2fs)",
            stats.step, stats.reward_mean, stats.loss, stats.kl, stats.clip_frac, stats.grad_norm,
            stats.samples, stats.seconds,
        )
        return stats
