"""The vLLM plugin (entry point ``vllm.general_plugins``: ``deltarl = deltarl.integrations.vllm.plugin:register``).

vLLM calls :func:`register` in every process it starts (the engine core, each worker). It

* asks Linux for AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``): vLLM's CPU
  attention picks AMX kernels, which die with SIGILL in a process that never asked for the state
  (whether oneDNN asked first is luck: about half the BF16 runs on the project's VMs);
* registers the ``deltarl`` weight-transfer engine (:mod:`.engine`) with vLLM's factory, lazily;
* on vLLM's CPU build, for engines started with ``weight_transfer_config={"backend": "deltarl"}``
  only, keeps linear and LM-head weights live: the CPU build otherwise copies each one into a
  oneDNN / SGL packed buffer and drops the parameter (``dispatch_cpu_unquantized_gemm``), so no
  in-place write could reach the matmul. The layer then multiplies with ``torch.nn.functional.linear``
  on its own parameter. Other engines in the same install are untouched;
* turns vLLM's ERROR log of a deltarl "ask again" answer (``[deltarl:NotStaged]``,
  ``[deltarl:NotPublished]``: a version still staging, or not committed yet; the client asks
  again) into one DEBUG line: vLLM logs every failed worker RPC with its traceback, in the worker
  and again in the engine core, and these answers are not failures (:class:`AskAgainFilter`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import re
from typing import Any

log = logging.getLogger(__name__)

BACKEND = "deltarl"
#: the vLLM releases deltarl's engine is tested with (both ends included; docs/integrations.md)
SUPPORTED_VLLM = ((0, 32), (0, 34))
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86-64
#: vLLM's loggers that report a failed worker RPC (``WorkerProc hit an exception``) and a failed
#: engine-core call (``Invocation of collective_rpc method failed``), each with its traceback
RPC_ERROR_LOGGERS = ("vllm.v1.executor.multiproc_executor", "vllm.v1.engine.core")
_ASK_AGAIN = re.compile(r"\[deltarl:(?:NotStaged|NotPublished)\]")


def request_amx() -> bool:
    """Ask the kernel for AMX tile state for this process (x86-64 Linux); True if granted.

    Harmless where AMX does not exist (the call fails and nothing changes)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


class AskAgainFilter(logging.Filter):
    """Drops an ERROR record whose exception is a deltarl "ask again" answer, logging it as one
    DEBUG line of ``deltarl.integrations.vllm.plugin`` instead; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno < logging.ERROR or exc is None:
            return True
        text = str(exc)
        if _ASK_AGAIN.search(text) is None:
            return True
        log.debug("deltarl: %s: %s", record.getMessage(), text.splitlines()[0][:300] if text else "")
        return False


def quiet_ask_again() -> None:
    """Put :class:`AskAgainFilter` on vLLM's RPC error loggers (once per process)."""
    for name in RPC_ERROR_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, AskAgainFilter) for f in logger.filters):
            logger.addFilter(AskAgainFilter())


def _deltarl_engine_configured() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    wt = getattr(cfg, "weight_transfer_config", None) if cfg is not None else None
    return wt is not None and getattr(wt, "backend", None) == BACKEND


def _keep_cpu_weights_live() -> None:
    """Wrap vLLM's CPU GEMM dispatch: for deltarl engines, a plain linear on the live parameter."""
    import torch
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_deltarl", False):
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if (not _deltarl_engine_configured() or weight is None or weight.is_meta or weight.ndim != 2
                or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32)):
            original(layer, remove_weight)
            return
        layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]  # (x, weight, bias): its live weight

    dispatch._deltarl = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch


def check_version(version: str) -> bool:
    """True if vLLM ``version`` (``"0.33.0"``, ``"0.34.1.dev3+g…"``) is in :data:`SUPPORTED_VLLM`;
    otherwise a warning, once per process (the engine is loaded anyway)."""
    parts = version.split(".")
    try:
        minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    lo, hi = SUPPORTED_VLLM
    if lo <= minor <= hi:
        return True
    log.warning("deltarl: vLLM %s is outside the tested window %d.%d-%d.%d", version, *lo, *hi)
    return False


def register() -> None:
    """vLLM's plugin hook: AMX state, the ``deltarl`` engine, live CPU weights, quiet "ask again"
    answers (see the module doc)."""
    request_amx()
    quiet_ask_again()
    import vllm

    check_version(getattr(vllm, "__version__", ""))
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    registry: dict[str, Any] = WeightTransferEngineFactory._registry
    if BACKEND not in registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "deltarl.integrations.vllm.engine", "DeltaRLEngine")
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:  # the trainer side, for processes that load plugins
        WeightTransferTrainerFactory.register_engine(BACKEND, "deltarl.integrations.vllm.trainer", "DeltaRLTrainerEngine")
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            _keep_cpu_weights_live()
    except ImportError as err:  # an older vLLM without the CPU dispatch: nothing to keep live
        log.debug("deltarl: vLLM CPU GEMM dispatch not found (%s)", err)
