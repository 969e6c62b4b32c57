# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine runs of a list of jobs: where each one's scores go, and running them.

A job has two engine runs (sides), each ``python -m hybridkv_lm_eval.run_side`` in
its own process, writing ``<results-dir>/<key>.json``. The key hashes everything
that decides the run's scores, so jobs that share a baseline (every TurboQuant job
of one model) share one file, and a file already there is reused.

By default the runner (``test_lm_eval_correctness.py``) starts the sides one after
the other, as each job needs them. ``run_all`` starts the distinct sides of several
jobs at once instead, at most ``max_parallel`` engine processes at a time, each
with its output in ``<key>.log``: engines with a fixed ``kv_cache_memory_bytes``
(and a small ``gpu_memory_utilization``, which vLLM checks against the free memory
at start) share one GPU; given ``gpus``, each side gets ``tp_size`` of them through
``CUDA_VISIBLE_DEVICES``, the least busy first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from . import config as job_config

HARNESS_DIR = Path(__file__).resolve().parent.parent

# Job settings shared by both engines that change what an engine run scores.
_SHARED_KEYS = (
    "model_name",
    "num_fewshot",
    "limit",
    "batch_size",
    "apply_chat_template",
    "fewshot_as_multiturn",
    "gen_kwargs",
    "trust_remote_code",
    "add_bos_token",
)


def side_key(config: dict[str, Any], role: str, tp_size: int) -> str:
    """What decides an engine's scores; equal keys give the same run."""
    shared = {k: config.get(k) for k in _SHARED_KEYS}
    # Which metrics are read from a run, and their tolerances, do not change the run.
    shared["tasks"] = [
        {k: v for k, v in t.items() if k != "metrics"} for t in config["tasks"]
    ]
    blob = json.dumps(
        {"shared": shared, "engine": job_config.side(config, role), "tp": tp_size},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def command(config_file: Path, role: str, tp_size: int, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hybridkv_lm_eval.run_side",
        "--config",
        str(config_file),
        "--role",
        role,
        "--tp-size",
        str(tp_size),
        "--out",
        str(out),
    ]


def environment(devices: str | None = None) -> dict[str, str]:
    """The side process's environment: this one, with the harness importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HARNESS_DIR), env.get("PYTHONPATH")])
    )
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return env


@dataclasses.dataclass
class Side:
    config_file: Path
    role: str
    key: str
    out: Path
    # Filled in by run_all.
    devices: str | None = None
    seconds: float | None = None
    returncode: int | None = None

    @property
    def log(self) -> Path:
        return self.out.with_suffix(".log")

    @property
    def failed(self) -> bool:
        """Ended without scores. run_side writes them atomically as its last
        step, so an engine that wrote them and then died in interpreter
        teardown (vLLM's engine threads can abort the process after main
        returns: "terminate called without an active exception", exit -6)
        has finished its measurement; ``ended_after_scores`` says so."""
        return self.returncode is not None and not self.out.is_file()

    @property
    def ended_after_scores(self) -> bool:
        return self.returncode not in (None, 0) and self.out.is_file()

    def describe(self) -> str:
        return f"{self.config_file.stem} {self.role} [{self.key}]"


def plan(config_files: Iterable[Path], tp_size: int, results_dir: Path) -> list[Side]:
    """The distinct sides of these jobs whose scores are not in ``results_dir``
    yet, in the order the jobs list them (each job's baseline first)."""
    sides: dict[str, Side] = {}
    for config_file in config_files:
        config = job_config.load(config_file)
        for role in ("baseline", "candidate"):
            key = side_key(config, role, tp_size)
            out = results_dir / f"{key}.json"
            if key not in sides and not out.is_file():
                sides[key] = Side(Path(config_file), role, key, out)
    return list(sides.values())


def device_groups(gpus: Sequence[str] | None, tp_size: int) -> list[str | None]:
    """``gpus`` cut into groups of ``tp_size`` (CUDA_VISIBLE_DEVICES values);
    [None] (leave the variable alone) when no GPUs are named."""
    if not gpus:
        return [None]
    if len(gpus) < tp_size:
        raise ValueError(
            f"{len(gpus)} GPUs ({','.join(gpus)}) cannot hold one engine of "
            f"tensor-parallel size {tp_size}"
        )
    return [
        ",".join(gpus[i : i + tp_size])
        for i in range(0, len(gpus) - tp_size + 1, tp_size)
    ]


def run_all(
    sides: Sequence[Side],
    tp_size: int,
    max_parallel: int,
    gpus: Sequence[str] | None = None,
    echo: Callable[[str], None] = print,
    poll_seconds: float = 1.0,
    stagger_seconds: float = 0.0,
) -> list[Side]:
    """Run ``sides``, at most ``max_parallel`` at a time; returns those that failed
    (non-zero exit, or no scores written). Each side's output goes to its log.
    ``stagger_seconds`` spaces the starts (engines starting in the same instant
    contend for the CPU and for free ports)."""
    if max_parallel < 1:
        raise ValueError(f"max_parallel must be at least 1, found {max_parallel}")
    groups = device_groups(gpus, tp_size)
    waiting = list(sides)
    running: list[tuple[Side, subprocess.Popen, float, Any]] = []
    started_all = time.monotonic()
    last_start = None
    try:
        while waiting or running:
            while waiting and len(running) < max_parallel:
                if last_start is not None:
                    time.sleep(
                        max(0.0, last_start + stagger_seconds - time.monotonic())
                    )
                side = waiting.pop(0)
                busy = {g: 0 for g in groups}
                for other, *_ in running:
                    busy[other.devices] += 1
                side.devices = min(groups, key=lambda g: busy[g])
                side.out.parent.mkdir(parents=True, exist_ok=True)
                log = open(side.log, "w")  # noqa: SIM115 (closed when it ends)
                proc = subprocess.Popen(
                    command(side.config_file, side.role, tp_size, side.out),
                    cwd=HARNESS_DIR,
                    env=environment(side.devices),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Its own process group: vLLM's engine-core child goes with it.
                    start_new_session=True,
                )
                where = (
                    f" on CUDA_VISIBLE_DEVICES={side.devices}" if side.devices else ""
                )
                echo(f"start {side.describe()}{where}; log {side.log}")
                last_start = time.monotonic()
                running.append((side, proc, last_start, log))
            time.sleep(poll_seconds)
            for item in list(running):
                side, proc, started, log = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                log.close()
                side.returncode = proc.returncode
                side.seconds = round(time.monotonic() - started, 1)
                verdict = "FAILED" if side.failed else "done"
                after = (
                    " after writing its scores, which are kept"
                    if side.ended_after_scores
                    else ""
                )
                echo(
                    f"{verdict} {side.describe()} in {side.seconds} s "
                    f"(exit {proc.returncode}{after}; "
                    f"{time.monotonic() - started_all:.0f} s since the first start)"
                )
    finally:
        # Interrupted (Ctrl-C, a pytest timeout): stop the engines we started.
        for _, proc, _, _ in running:
            _signal_group(proc, signal.SIGTERM)
        for _, proc, _, log in running:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            log.close()
    return [s for s in sides if s.failed]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to the process group ``proc`` leads (started by run_all)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])
