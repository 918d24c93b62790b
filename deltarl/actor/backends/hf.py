"""The transformers generation backend (CPU and GPU): batched sampling with per-token logprobs,
and its adapter for the actor (:func:`open_weights`, :func:`build`; the table row is ``hf``).

The model is held in BF16 (the dtype the trainer exports and the publisher ships), so the live
parameters are bit for bit the exported tensors, by the same names. Sampling is a plain decode loop
over a KV cache (left-padded batch, explicit position ids), which keeps the reported logprob of each
token exactly the one of the distribution it was drawn from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from deltarl.actor.backends.base import FinishReason, Generation, ThroughputMeter

if TYPE_CHECKING:
    import torch

    from deltarl.actor.config import ActorConfig
    from deltarl.actor.weights import Weights
    from deltarl.model.build import ModelSpec
    from deltarl.model.record import RunModelInfo
    from deltarl.storage.store import ObjectStore

log = logging.getLogger(__name__)


class HFBackend:
    """Generate with a ``transformers`` causal LM held in BF16.

    ``throttle`` >= 1 emulates hardware that many times slower: after each batch the backend sleeps
    ``(throttle - 1) x`` the batch's compute time, so one machine can host a fleet of unequal actors.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_id: int,
        pad_token_id: int,
        seed: int = 0,
        throttle: float = 1.0,
        max_batch: int = 256,
    ) -> None:
        import torch

        if throttle < 1.0:
            raise ValueError("throttle must be >= 1 (1 = native speed)")
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.model = model.to(dtype=torch.bfloat16).eval()
        self.device = next(model.parameters()).device
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.throttle = float(throttle)
        self.max_batch = max_batch
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(seed)
        self._meter = ThroughputMeter()
        self.last_compute_s = 0.0  # compute time of the last generate call
        self.last_throttle_s = 0.0  # throttle sleep added after it

    @classmethod
    def from_spec(
        cls,
        spec: ModelSpec,
        *,
        eos_token_id: int,
        pad_token_id: int,
        state: dict[str, torch.Tensor] | None = None,
        device: str = "cpu",
        **kwargs: Any,
    ) -> HFBackend:
        """Build the BF16 model of ``spec`` on ``device`` and load ``state`` (an exported version) into it."""
        import torch

        from deltarl.model.build import build_model, load_bf16_into

        model = build_model(spec, dtype=torch.bfloat16, device=device)
        if state is not None:
            load_bf16_into(model, state)
        return cls(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)

    # --- GenerationBackend ---------------------------------------------------------------------
    @property
    def tokens_per_second(self) -> float | None:
        return self._meter.value

    def state_dict_for_update(self) -> dict[str, torch.Tensor]:
        """The live BF16 parameters by exported name (tied weights once): write in place to update."""
        from deltarl.model.build import live_parameters

        return live_parameters(self.model)

    def commit(self, staged: Any) -> None:
        """Commit a ``StagedUpdate`` staged against :meth:`state_dict_for_update` (rolled back on failure)."""
        try:
            staged.commit()
        except BaseException:
            log.error("commit failed; rolling back to the staged base")
            staged.rollback()
            raise

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Overwrite every parameter with a full exported state (names and shapes checked first)."""
        from deltarl.model.build import load_bf16_into

        load_bf16_into(self.model, dict(state))

    def served_digest(self) -> str:
        """The state digest of the live parameters."""
        from deltarl.codec.tensors import state_digest

        return str(state_digest(self.state_dict_for_update()))

    def close(self) -> None:
        """Nothing to release: the model is this process's memory."""

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float, n: int = 1
    ) -> list[Generation]:
        """Sample ``n`` completions per prompt (flat, prompt-major), with sampled-token logprobs."""
        if max_new_tokens < 1 or n < 1 or temperature < 0:
            raise ValueError("need max_new_tokens >= 1, n >= 1 and temperature >= 0")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        rows = [list(p) for p in prompts for _ in range(n)]
        t0 = time.perf_counter()
        out: list[Generation] = []
        for i in range(0, len(rows), self.max_batch):
            out.extend(self._generate_batch(rows[i : i + self.max_batch], max_new_tokens, temperature))
        elapsed = time.perf_counter() - t0
        self.last_compute_s = elapsed
        self.last_throttle_s = elapsed * (self.throttle - 1.0)
        if self.last_throttle_s > 0:
            time.sleep(self.last_throttle_s)
        tokens = sum(len(g.completion_token_ids) for g in out)
        self._meter.record(tokens, time.perf_counter() - t0)
        log.debug("generated %d completions, %d tokens in %.3fs", len(out), tokens, time.perf_counter() - t0)
        return out

    # --- internals -----------------------------------------------------------------------------
    def _generate_batch(self, rows: list[list[int]], max_new: int, temperature: float) -> list[Generation]:
        import torch

        if not rows:
            return []
        dev = self.device
        bsz, width = len(rows), max(len(r) for r in rows)
        ids = torch.full((bsz, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((bsz, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        finished = torch.zeros(bsz, dtype=torch.bool, device=dev)
        toks: list[torch.Tensor] = []
        lps: list[torch.Tensor] = []
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
            next_pos = pos[:, -1:] + 1
            for step in range(max_new):
                logits = out.logits[:, -1, :].float()
                if temperature > 0:
                    logp = torch.log_softmax(logits / temperature, dim=-1)
                    tok = torch.multinomial(logp.exp(), 1, generator=self._gen).squeeze(1)
                else:
                    logp = torch.log_softmax(logits, dim=-1)
                    tok = logp.argmax(dim=-1)
                lp = logp.gather(1, tok[:, None]).squeeze(1)
                tok = torch.where(finished, torch.full_like(tok, self.pad_token_id), tok)
                toks.append(tok)
                lps.append(lp)
                finished = finished | (tok == self.eos_token_id)
                if step == max_new - 1 or bool(finished.all()):
                    break
                mask = torch.cat([mask, torch.ones((bsz, 1), dtype=mask.dtype, device=dev)], dim=1)
                out = self.model(
                    input_ids=tok[:, None],
                    attention_mask=mask,
                    position_ids=next_pos,
                    cache=out.cache,
                    use_cache=True,
                )
                next_pos = next_pos + 1
        tok_m = torch.stack(toks, dim=1).cpu().tolist()
        lp_m = torch.stack(lps, dim=1).cpu().tolist()
        gens: list[Generation] = []
        for trow, lrow in zip(tok_m, lp_m, strict=True):
            stopped = self.eos_token_id in trow
            n_keep = trow.index(self.eos_token_id) + 1 if stopped else len(trow)
            reason: FinishReason = "stop" if stopped else "length"
            gens.append(Generation([int(t) for t in trow[:n_keep]], [float(x) for x in lrow[:n_keep]], reason))
        return gens


# --- the actor's adapter (deltarl.actor.backends.table.BACKENDS["hf"]) --------------------------------------
def open_weights(config: ActorConfig, store: ObjectStore | None) -> Weights:
    """The subscriber-backed weights handle: the live parameters are the state it commits into."""
    from deltarl.actor.weights import Weights

    return Weights(config, store)  # relays first, the origin (if any) last: model.json too


def build(config: ActorConfig, info: RunModelInfo, tokenizer: Any, weights: Weights) -> tuple[HFBackend, Any]:
    """The run's model in BF16 on ``config.device``; its live parameters are what the bootstrap fills."""
    backend = HFBackend.from_spec(info.model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  device=config.device, seed=config.seed, throttle=config.throttle,
                                  max_batch=config.max_batch)
    return backend, backend.state_dict_for_update()
