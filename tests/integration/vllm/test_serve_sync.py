"""``deltarl serve-sync`` against real ``vllm serve`` processes (vLLM's CPU build): two servers follow
five versions while one is killed and restarted; 8 requests in flight across a commit all finish;
after the run each server's greedy tokens and logprobs, on a long prompt served before the updates
(its prefix cached under version 0), equal a fresh server's on ``replay(5)``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.integration.vllm.conftest import SPEC

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(1800)]

VERSIONS = 5
LONG = [(i * 37 + 11) % 256 for i in range(200)]  # a 200-token prompt: its prefix is cached before the updates


def server_command(ckpt: Path, port: int) -> list[str]:
    """The ``vllm serve`` command line of docs/integrations.md (the module form: the CPU build's
    ``vllm`` script cannot find its own distribution)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--port", str(port),
            "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "8", "--seed", "0",
            "--weight-transfer-config", '{"backend": "deltarl"}',
            "--worker-extension-cls", "deltarl.integrations.vllm.worker.DeltaRLWorkerExtension"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return int(resp.status)


def start_server(ckpt: Path, log: Path, port: int | None = None) -> dict[str, Any]:
    """A ``vllm serve`` on ``ckpt``, started (not yet up): ``{"url", "proc", "port"}``."""
    port = port or _free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(server_command(ckpt, port), env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return {"url": f"http://127.0.0.1:{port}", "proc": proc, "port": port}


@contextmanager
def vllm_servers(ckpt: Path, logs: list[Path]) -> Iterator[list[dict[str, Any]]]:
    """``vllm serve`` processes on ``ckpt``, one per log, started together; yields them once each
    answers ``/health``, kills them after."""
    servers = [start_server(ckpt, log) for log in logs]
    try:
        for srv, log in zip(servers, logs, strict=True):
            wait_up(srv, log)
        yield servers
    finally:
        for srv in servers:
            kill(srv)


def wait_up(srv: dict[str, Any], log: Path, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if srv["proc"].poll() is not None:
            pytest.fail(f"vllm serve exited {srv['proc'].returncode}:\n{log.read_text()[-3000:]}")
        try:
            if _get(srv["url"] + "/health") == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"vllm serve did not come up in {timeout_s} s:\n{log.read_text()[-3000:]}")


def kill(srv: dict[str, Any]) -> None:
    proc = srv["proc"]
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the server and the engine core it started
        proc.wait()


def complete(url: str, prompt: list[int], max_tokens: int, timeout: float = 300.0) -> dict[str, Any]:
    body = {"model": _model(url), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return dict(json.loads(resp.read())["choices"][0])


def _model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


def greedy(url: str) -> list[tuple[list[int], list[float]]]:
    out = []
    for prompt in (LONG, [72, 101, 108, 108, 111]):
        c = complete(url, prompt, 12)
        out.append(([int(t) for t in c["token_ids"]], [float(x) for x in c["logprobs"]["token_logprobs"]]))
    return out


def served(url: str) -> int | None:
    from deltarl.integrations.vllm.serve_sync import server_status

    try:
        v = server_status(url).get("version")
    except Exception:
        return None
    return None if v is None else int(v)


def wait_for(cond: Any, what: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.3)
    pytest.fail(f"timed out waiting for {what}")


def test_serve_sync_keeps_two_servers_on_head(tmp_path: Path) -> None:
    from deltarl.codec import state_digest
    from deltarl.model.build import ModelSpec
    from deltarl.pipeline.publisher import Publisher
    from deltarl.storage.open import open_store
    from deltarl.testing.vllm_runs import evolve, write_checkpoint

    states = [write_checkpoint(tmp_path / "ckpt", ModelSpec(**SPEC))]
    for v in range(1, VERSIONS + 1):
        states.append(evolve(states[-1], 0.01, seed=50 + v))
    store_url = str(tmp_path / "store")
    store = open_store(store_url)
    pub = Publisher(store, "s", keyframe_interval=3, digest_interval=1)
    pub.publish(states[0], 0)
    logs = tmp_path / "logs"
    logs.mkdir()
    with vllm_servers(tmp_path / "ckpt", [logs / "a.log", logs / "b.log"]) as (a, b), \
            open(logs / "sync.log", "wb") as sync_out:
        sync = subprocess.Popen(
            [sys.executable, "-m", "deltarl.cli", "serve-sync", "s", "--store", store_url, "--server", a["url"],
             "--server", b["url"], "--pause", "wait", "--poll", "0.2", "--max-backoff", "4", "--until-version", str(VERSIONS),
             "--report", str(tmp_path / "report.json"), "--metrics-port", "0"],
            stdout=sync_out, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: served(a["url"]) == 0 and served(b["url"]) == 0, "both servers attached at 0")
            before = greedy(a["url"])  # the long prompt's prefix is now cached under version 0
            assert greedy(b["url"]) == before
            for v in (1, 2):
                pub.publish(states[v], v)
            wait_for(lambda: served(a["url"]) == 2 and served(b["url"]) == 2, "both servers at 2")
            kill(b)  # one server dies mid-run; the other keeps following
            pub.publish(states[3], 3)
            wait_for(lambda: served(a["url"]) == 3, "server a at 3 while b is down")
            b["proc"] = start_server(tmp_path / "ckpt", logs / "b.log", b["port"])["proc"]  # back, serving nothing yet
            wait_up(b, logs / "b.log")
            wait_for(lambda: served(b["url"]) == 3, "restarted server b re-attached at HEAD")
            with ThreadPoolExecutor(8) as pool:  # 8 requests in flight on a while version 4 commits
                running = [pool.submit(complete, a["url"], LONG[: 20 + i], 200) for i in range(8)]
                time.sleep(1.0)
                pub.publish(states[4], 4)
                done = [f.result() for f in running]
            assert [c["finish_reason"] for c in done] == ["length"] * 8
            assert all(len(c["token_ids"]) == 200 for c in done)
            pub.publish(states[5], 5)
            assert sync.wait(timeout=240) == 0, (logs / "sync.log").read_text()[-3000:]
            report = json.loads((tmp_path / "report.json").read_text())
            after = [greedy(a["url"]), greedy(b["url"])]
        finally:
            if sync.poll() is None:
                sync.kill()
            pub.close()
            store.close()
    want = state_digest(states[VERSIONS])
    assert [(r["version"], r["digest"]) for r in report] == [(VERSIONS, want)] * 2
    assert report[1]["attaches"] == 2  # at the start and after its restart
    ckpt5 = tmp_path / "replay-5"
    _checkpoint_of(store_url, tmp_path / "ckpt", ckpt5)
    with vllm_servers(ckpt5, [logs / "fresh.log"]) as (fresh,):
        assert after == [greedy(fresh["url"])] * 2  # tokens and logprobs, exactly, long prompt included
        trl_protocol(fresh["url"], tmp_path, states)


def trl_protocol(url: str, tmp_path: Path, states: list[dict[str, Any]]) -> None:
    """TRL's ``WeightTransferProtocol`` as ``AsyncGRPOTrainer`` calls it (init; per sync pause,
    send_weights, resume; destroy) on the same server, a run of its own: after each sync the server
    serves the sent state bit for bit and ``/weight_info`` names its version."""
    from deltarl.codec import state_digest
    from deltarl.integrations.vllm.serve_sync import call_route, server_status
    from deltarl.integrations.vllm.trl_async import DeltaRLWeightTransfer

    transfer = DeltaRLWeightTransfer([url], str(tmp_path / "trl-store"), "trl", pause_mode="keep",
                                     publish={"digest_interval": 1})
    transfer.init_weight_transfer()
    try:
        for v, state in enumerate(states[:3]):
            transfer.pause()
            transfer.send_weights(iter(state.items()))
            transfer.resume()
            st = server_status(url, digest=True)
            assert (st["version"], st["digest"]) == (v, state_digest(state))
            assert call_route(url, "weight_info", method="GET") == {"weight_version": str(v)}
            assert complete(url, [72, 101], 4)["finish_reason"] == "length"  # resumed
    finally:
        transfer.destroy()


def _checkpoint_of(store_url: str, ckpt: Path, out: Path) -> None:
    import shutil

    from safetensors.torch import save_file

    from deltarl.pipeline.replay import replay
    from deltarl.storage.open import open_store

    shutil.copytree(ckpt, out, ignore=shutil.ignore_patterns("*.safetensors"))
    store = open_store(store_url, must_exist=True)
    try:
        save_file(replay(store, "s", VERSIONS), str(out / "model.safetensors"), metadata={"format": "pt"})
    finally:
        store.close()
