"""Log-probabilities of given completion tokens under a causal LM (training and rescoring)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def completion_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs of each completion given its prompt, under ``logits / temperature``.

    Rows are ``prompt + completion``, right-padded, so positions count from 0 as in generation.
    Returns ``(logprobs, mask)``, both ``[batch, longest completion]``; ``logprobs`` is FP32 and
    carries gradients when the model does; ``mask`` is 1 on real completion tokens. ``temperature``
    0 means the raw distribution (greedy sampling reports those).
    """
    import torch

    if len(prompts) != len(completions):
        raise ValueError("one completion per prompt")
    device = next(model.parameters()).device
    bsz = len(prompts)
    t_max = max((len(c) for c in completions), default=0)
    if bsz == 0 or t_max == 0:
        empty = torch.zeros((bsz, t_max), device=device)
        return empty, empty
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    ids = torch.full((bsz, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((bsz, width), dtype=torch.long)
    # index of the logit that predicts completion token j of row i: len(prompt_i) - 1 + j
    gather_pos = torch.zeros((bsz, t_max), dtype=torch.long)
    targets = torch.full((bsz, t_max), 0, dtype=torch.long)
    mask = torch.zeros((bsz, t_max))
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if not p:
            raise ValueError("every prompt needs at least one token")
        row = list(p) + list(c)
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attn[i, : len(row)] = 1
        if c:
            gather_pos[i, : len(c)] = torch.arange(len(p) - 1, len(p) - 1 + len(c))
            targets[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
            mask[i, : len(c)] = 1.0
    ids, attn = ids.to(device), attn.to(device)
    gather_pos, targets, mask = gather_pos.to(device), targets.to(device), mask.to(device)
    # logits only from the first position that predicts a completion token on (not the prompts)
    first = min(len(p) for p in prompts) - 1
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=width - first).logits
    picked = logits.gather(1, (gather_pos - first).clamp(min=0)[:, :, None].expand(-1, -1, logits.shape[-1])).float()
    if temperature > 0:
        picked = picked / temperature
    logp = torch.log_softmax(picked, dim=-1).gather(2, targets[:, :, None]).squeeze(2)
    return logp * mask, mask
