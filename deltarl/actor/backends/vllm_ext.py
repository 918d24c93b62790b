"""The vLLM backend (optional extra ``deltarl[vllm]``): a worker extension that applies staged sparse
updates in place to vLLM's fused, tensor-parallel parameters, and a :class:`GenerationBackend`.

vLLM is imported lazily; this module imports without it. Start vLLM with
``worker_extension_cls=VLLM_EXTENSION`` (``vllm serve --worker-extension-cls ...``); every
tensor-parallel worker then has the ``deltarl_*`` methods, called through ``LLM.collective_rpc``.

Commit protocol on the workers (each rank independently, same call):

1. ``deltarl_prepare(changes)``, off the pause: ``changes`` maps HF tensor names to ``(shape, flat
   indices, BF16 values)``. Each rank maps them to its local fused shard (:mod:`.vllm_mapping`),
   checks every target and bound, moves indices and values to the device and reads the old values
   at those positions (kept for rollback). Nothing is written.
2. ``deltarl_commit()``, the pause: checks that every position still holds its old or new value
   (one sync; a refused commit writes nothing), then writes the new values with ``index_copy_``.
   ``deltarl_apply(changes)`` is both at once. Re-applying the same changes is harmless.
3. ``deltarl_rollback()`` restores the old values of the last commit; ``deltarl_forget()`` drops them.

The prefix cache holds KV computed with the old weights: :class:`VLLMBackend` resets it after
every commit and rollback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from deltarl.actor.backends.base import FinishReason, Generation, ThroughputMeter
from deltarl.actor.backends.vllm_mapping import FusedLayout, map_sparse, unshard_state
from deltarl.errors import StagingError, TensorMismatch

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

VLLM_EXTENSION = f"{__name__}.DeltaRLWorkerExtension"

#: HF tensor name -> (HF shape, flat int64 indices, BF16 absolute values), all CPU tensors
Changes = dict[str, tuple[tuple[int, ...], "torch.Tensor", "torch.Tensor"]]


class DeltaRLWorkerExtension:
    """Mixed into vLLM's GPU worker by ``worker_extension_cls``; ``self`` is the worker.

    Uses ``self.model_runner.model`` (the vLLM model), its ``model_config.hf_config`` and the
    tensor-parallel rank and size from ``vllm.distributed``.
    """

    model_runner: Any

    # --- hooks (overridable: tests run the extension on a CPU stand-in) -------------------------
    def _deltarl_tp(self) -> tuple[int, int]:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())

    def _deltarl_hf_config(self) -> Any:
        return self.model_runner.model_config.hf_config

    def _deltarl_params(self) -> dict[str, torch.Tensor]:
        return {name: p.data for name, p in self.model_runner.model.named_parameters()}

    # --- RPC methods ---------------------------------------------------------------------------
    def deltarl_layout(self) -> FusedLayout:
        _, size = self._deltarl_tp()
        return FusedLayout.from_hf_config(self._deltarl_hf_config(), tp_size=size)

    def deltarl_prepare(self, changes: Changes) -> int:
        """Check ``changes`` and move them to the device (nothing written); return elements prepared."""
        import torch

        self._deltarl_plan: list[tuple[torch.Tensor, ...]] | None = None
        rank, _ = self._deltarl_tp()
        layout = self.deltarl_layout()
        params = self._deltarl_params()
        plan: list[tuple[torch.Tensor, ...]] = []
        for name, (shape, idx, vals) in changes.items():
            if idx.numel() != vals.numel():
                raise TensorMismatch(f"{name}: {idx.numel()} indices for {vals.numel()} values")
            target, local, v = map_sparse(name, tuple(shape), idx.to(torch.int64), vals, layout, rank)
            param = params.get(target)
            if param is None:
                raise TensorMismatch(f"{name} maps to {target!r}, which this vLLM model does not have")
            if param.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
                raise TensorMismatch(f"{target}: expected BF16 parameter and values, got {param.dtype}/{v.dtype}")
            if local.numel() and (int(local.min()) < 0 or int(local.max()) >= param.numel()):
                raise TensorMismatch(f"{name} -> {target}: index outside the local shard of {param.numel()} elements")
            if local.numel():
                flat = param.view(-1)
                dev_idx = local.to(flat.device)
                plan.append((flat, dev_idx, v.to(flat.device), flat.index_select(0, dev_idx).clone()))
        self._deltarl_plan = plan
        return sum(int(p[1].numel()) for p in plan)

    def deltarl_commit(self) -> int:
        """Write the prepared values in place (the pause); return elements written.

        Refused, with nothing written, if any position holds neither its prepared old value nor the
        new one (the weights moved since ``deltarl_prepare``)."""
        import torch

        plan = getattr(self, "_deltarl_plan", None)
        if plan is None:
            raise StagingError("no prepared update to commit")
        if plan:
            ok = torch.stack([((flat[idx] == old) | (flat[idx] == v)).all() for flat, idx, v, old in plan])
            if not bool(ok.all()):
                raise StagingError("the weights changed since the update was prepared; nothing written")
        for flat, idx, v, _ in plan:
            flat.index_copy_(0, idx, v)
        self._deltarl_undo: list[tuple[torch.Tensor, ...]] | None = [(f, i, o) for f, i, _, o in plan]
        self._deltarl_plan = None
        written = sum(int(p[1].numel()) for p in plan)
        log.debug("rank %d: wrote %d elements in place", self._deltarl_tp()[0], written)
        return written

    def deltarl_apply(self, changes: Changes) -> int:
        """Prepare and commit ``changes`` (all checked before any write); return elements written."""
        self._deltarl_undo = []  # nothing written yet: a failed apply leaves nothing to restore
        self.deltarl_prepare(changes)
        return self.deltarl_commit()

    def deltarl_rollback(self) -> int:
        """Restore the values the last ``deltarl_apply`` overwrote; return elements restored."""
        undo = getattr(self, "_deltarl_undo", None)
        if undo is None:
            raise StagingError("no applied update to roll back")
        for flat, idx, old in undo:
            flat.index_copy_(0, idx, old)
        self._deltarl_undo = None
        return sum(int(idx.numel()) for _, idx, _ in undo)

    def deltarl_forget(self) -> None:
        """Drop the rollback values of the last apply (after the actor has committed it)."""
        self._deltarl_undo = None

    def deltarl_load_full(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a full HF-named state with vLLM's own loader (it fuses and shards)."""
        self.model_runner.model.load_weights(weights=list(state.items()))
        self._deltarl_undo = None

    def deltarl_local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's parameters as CPU tensors (for digests and tests; copies the whole model)."""
        return {k: v.detach().cpu().clone() for k, v in self._deltarl_params().items()}


def staged_changes(staged: Any, shapes: Mapping[str, tuple[int, ...]]) -> Changes:
    """The changed positions and new BF16 values of a codec ``StagedUpdate``, per HF tensor name."""
    import numpy as np
    import torch

    items = {name: (pos, new) for name, (pos, _old, new) in staged.changes().items()}
    out: Changes = {}
    for name, (pos, new) in items.items():
        bits = np.ascontiguousarray(new)
        if bits.dtype != np.uint16:
            raise TensorMismatch(f"{name}: the vLLM backend serves BF16, the update holds {bits.dtype} values")
        out[name] = (
            tuple(shapes[name]),
            torch.from_numpy(np.ascontiguousarray(pos, dtype=np.int64)),
            torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16),
        )
    return out


class VLLMBackend:
    """Generation with vLLM (GPU); updates committed in place through the worker extension.

    ``state_dict_for_update()`` is a host shadow of the served weights by HF name (the codec stages
    against it: it reads old values there); :meth:`commit` sends the staged changes to every worker,
    then commits the shadow. The shadow costs one BF16 copy of the model in host memory.
    """

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        throttle: float = 1.0,
        shadow: dict[str, torch.Tensor] | None = None,
        **llm_kwargs: Any,
    ) -> None:
        from vllm import LLM

        if throttle < 1.0:
            raise ValueError("throttle must be >= 1 (1 = native speed)")
        self.throttle = throttle
        self.llm = LLM(
            model=model_path,
            tensor_parallel_size=tensor_parallel_size,
            dtype="bfloat16",
            seed=seed,
            worker_extension_cls=VLLM_EXTENSION,
            logprobs_mode="processed_logprobs",  # logprobs after temperature, as the trainer computes them
            **llm_kwargs,
        )
        self._shadow = shadow if shadow is not None else _load_hf_state(model_path)
        self._meter = ThroughputMeter()
        self._prepared: Any = None  # the staged update the workers hold on the GPU (prepare())

    @property
    def tokens_per_second(self) -> float | None:
        return self._meter.value

    def state_dict_for_update(self) -> dict[str, torch.Tensor]:
        return self._shadow

    def prepare(self, staged: Any) -> None:
        """Send a staged update to every worker, which maps it to its shards and moves it to the
        GPU, nothing written (off the pause; call it from the thread that drives the LLM)."""
        changes = staged_changes(staged, {k: tuple(v.shape) for k, v in self._shadow.items()})
        self._prepared = None
        self.llm.collective_rpc("deltarl_prepare", args=(changes,))
        self._prepared = staged

    def commit(self, staged: Any) -> None:
        """Commit a staged update to the shadow, then on every worker (prepared first unless
        :meth:`prepare` already did): the pause is a check and an in-place scatter per worker.
        On failure both are rolled back."""
        if self._prepared is not staged:
            self.prepare(staged)
        self._prepared = None
        staged.commit()  # the shadow first: the codec checks it still holds the base
        try:
            self.llm.collective_rpc("deltarl_commit")
        except BaseException:
            try:
                self.llm.collective_rpc("deltarl_rollback")
                staged.rollback()
            finally:
                self.llm.reset_prefix_cache()
            raise
        self.llm.collective_rpc("deltarl_forget")
        self.llm.reset_prefix_cache()

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Overwrite every served weight (and the shadow) with a full exported state."""
        if set(state) != set(self._shadow):
            raise TensorMismatch("state names differ from the served model's")
        self.llm.collective_rpc("deltarl_load_full", args=(dict(state),))
        for name, t in state.items():
            self._shadow[name].copy_(t)
        self.llm.reset_prefix_cache()

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float, n: int = 1
    ) -> list[Generation]:
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, logprobs=0, detokenize=False)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        gens: list[Generation] = []
        for out in outs:
            for c in out.outputs:
                ids = [int(t) for t in c.token_ids]
                lps = [float(c.logprobs[i][t].logprob) for i, t in enumerate(ids)] if c.logprobs else []
                reason: FinishReason = "stop" if c.finish_reason == "stop" else "length"
                gens.append(Generation(ids, lps, reason))
        elapsed = time.perf_counter() - t0
        if self.throttle > 1.0:
            time.sleep(elapsed * (self.throttle - 1.0))
        self._meter.record(sum(len(g.completion_token_ids) for g in gens), time.perf_counter() - t0)
        return gens

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The served weights gathered from every rank and un-fused to HF names (for state digests)."""
        shards = self.llm.collective_rpc("deltarl_local_shards")
        layout = self.llm.collective_rpc("deltarl_layout")[0]
        return unshard_state(list(shards), {k: tuple(v.shape) for k, v in self._shadow.items()}, layout)


def _load_hf_state(path: str) -> dict[str, torch.Tensor]:
    """The BF16 HF state of a local checkpoint, tied weights once (the names the trainer exports)."""
    import torch

    from deltarl.model.build import ModelSpec, build_model, export_bf16

    return export_bf16(build_model(ModelSpec(name=path), dtype=torch.bfloat16))
