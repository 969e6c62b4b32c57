# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU release gate: every GPU check of the series in one device call,
or two where one does not hold it (``--lanes`` and ``--combine``).

Five lanes run side by side, each in its own process group, on the GPUs
there are (two: the matrix alone on the first; one: all on it; a call
without the matrix: kernels and suite on the first of two, see
``lanes_for``):

* ``spec``: the speculative-decoding matrix's gate cells
  (``spec_decode_matrix --gate``: every model with every speculation method
  it has, auto and turboquant_4bit_nc, eager and FULL CUDA graphs, plus
  k8v4 and 3bit_nc with MTP), each cell token-exact against the same engine
  without speculation or first different at a near-tie (shown as ``tie``);
* ``kernels``: tests/kernels natively (every kernel against float64),
  ``KERNEL_JOBS`` test files at a time where pytest-xdist is installed;
* ``tqm``: the TurboQuant x hybrid matrix (``turboquant_matrix``: every
  preset, with and without MTP or a draft, padded pages), against
  transformers' fp32 decode, the same preset without speculation (near-ties
  as in ``spec``, shown as ``ok tie``) and auto;
* ``suite``: the other GPU tests (``pytest -m gpu`` over tests/v1,
  tests/plugins_tests and tests/models), each in its own pytest process,
  ``SUITE_JOBS`` at a time;
* ``serve``: ``vllm serve --skip-tokenizer-init`` with TurboQuant answers a
  prompt with an out-of-vocabulary token id with HTTP 400 and keeps serving.

Engines get fixed KV budgets (no memory-profiling collisions) and compile
groups (scheduling.py: no side-by-side cold compiles of the same kernels).
A lane still running at ``--deadline`` is stopped and its unfinished cells
count as failures: a gate that runs out of time is red, and its record says
which cells the deadline cut (``out_of_time``).

    python -m tests.gpu_gate OUTDIR [--deadline S] [--jobs N] [--lanes L,...]
    python -m tests.gpu_gate OUTDIR --combine PART_OUTDIR [PART_OUTDIR ...]

Prints one table (cell, status, seconds, first root-cause line of each
failure) and writes OUTDIR/gate.json and OUTDIR/gate.md; the lanes' logs
and results go into OUTDIR/logs.tar.gz, and nothing else stays in OUTDIR
(``--keep-work`` keeps the checkpoints and work folders too). Exit status 0 when
every cell passed, 1 when any failed or did not finish (or a run of some
lanes only), 2 for bad arguments, a host without a GPU, or parts that do not
combine (other releases, runtimes or GPU models, a lane twice).
"""

import argparse
import importlib.util
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.models.tiny_hybrids.ports import PORT_BASE_ENV, lane_base, share_env
from tests.models.tiny_hybrids.scheduling import NOT_RUN, run_grouped
from tests.models.tiny_hybrids.spec_decode_matrix import first_root_cause, same_or_tie

# GPU-marked tests; tests/kernels runs whole (its float64 checks run natively
# on a GPU through the ``triton_device`` fixture), and the TurboQuant x hybrid
# matrix that test_turboquant_hybrids_generate.py wraps runs as its own lane,
# which records every engine even when the deadline stops it.
SUITE_PATHS = ("tests/v1", "tests/plugins_tests", "tests/models")
TQM_TEST = "tests/models/tiny_hybrids/test_turboquant_hybrids_generate.py"
# A diff at a flagged near-tie passes too (spec_decode_matrix.same_or_tie),
# and the table shows it.
PASSING = ("exact", "passed", "skipped", "ok")
# The suite's tests boot engines, each in a process of its own; run one after
# another beside the other lanes they did not finish in 530 s on 2 x H100.
SUITE_JOBS = 4
SUITE_TIMEOUT = 260
# tests/kernels compiles a kernel for nearly every case: one pytest process
# took 511 s of a 560-s deadline on 2 x H200 (release 41). pytest-xdist
# workers, a test file each at a time, where the runtime has it.
KERNEL_JOBS = 4


@dataclass
class Row:
    lane: str
    cell: str
    status: str
    seconds: float | None = None
    root_cause: str = ""

    @property
    def passed(self) -> bool:
        return self.status in PASSING or same_or_tie(self.status)


@dataclass
class Lane:
    name: str
    cmd: list[str]
    gpu: int
    proc: subprocess.Popen | None = None
    log: Path | None = None
    started: float = 0.0
    seconds: float | None = None
    rc: int | str | None = None


# --------------------------------------------------------------------------
# Reading each lane's results.
# --------------------------------------------------------------------------


def spec_rows(matrix_json: Path, lane: Lane) -> list[Row]:
    if not matrix_json.exists():
        return [_unfinished(lane)]
    data = json.loads(matrix_json.read_text())
    rows = []
    for r in data["rows"]:
        key = f"{r['model']}.{r['kv']}.{r['spec']}.{r['cg']}"
        rec = data["records"].get(key, {})
        rows.append(
            Row(
                "spec",
                key,
                r.get("status", "?"),
                rec.get("wall"),
                r.get("root_cause") or _first_diff(r),
            )
        )
    return rows


def _first_diff(row: dict) -> str:
    if row.get("status") == "exact" or not row.get("first_diffs"):
        return ""
    p, t = row["first_diffs"][0]
    equal = row["prompts_exact"]
    return f"prompt {p} differs from no speculation at token {t} ({equal} equal)"


def junit_rows(junit_xml: Path, lane: Lane) -> list[Row]:
    if not junit_xml.exists():
        return [_unfinished(lane)]
    rows = []
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        status, cause = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                status = {"failure": "failed"}.get(tag, tag)
                text = (el.get("message") or el.text or "").strip()
                cause = text.splitlines()[0][:200] if text else ""
                break
        rows.append(Row(lane.name, name, status, float(case.get("time", 0)), cause))
    if lane.rc not in (0, 1) and not rows:
        return [_unfinished(lane)]
    return rows


def suite_rows(suite_dir: Path, lane: Lane) -> list[Row]:
    nodes_json = suite_dir / "nodes.json"
    if not nodes_json.exists():
        return [_unfinished(lane)]
    rows: list[Row] = []
    for i, node in enumerate(json.loads(nodes_json.read_text())):
        xml = suite_dir / f"{i:03d}.xml"
        got = junit_rows(xml, lane) if xml.exists() else []
        # A test whose own process did not write its report was stopped at
        # the deadline (or never started): it failed, and says so.
        rows += got or [
            Row(
                lane.name,
                node,
                "NOT FINISHED",
                None,
                _log_tail(suite_dir / f"{i:03d}.log"),
            )
        ]
    return rows


def tqm_rows(result_json: Path, lane: Lane) -> list[Row]:
    if not result_json.exists():
        return [_unfinished(lane)]
    rows = []
    for r in json.loads(result_json.read_text()):
        cause = ""
        if not r["ok"]:
            tail = r.get("log_tail") or ""
            cause = f"vs {r['against']}: {r['why']}"
            if tail:
                cause += f"; {first_root_cause(tail)}"
        status = "ok" if r["ok"] else "FAILED"
        if r["ok"] and r.get("tie"):
            status, cause = "ok tie", r["tie"]
        rows.append(Row("tqm", r["name"], status, r.get("seconds"), cause[:200]))
    return rows


def serve_rows(result_json: Path, lane: Lane) -> list[Row]:
    if not result_json.exists():
        return [_unfinished(lane)]
    return [Row(**r) for r in json.loads(result_json.read_text())]


def _log_tail(log: Path | None) -> str:
    if not log or not log.exists():
        return ""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln]
    return lines[-1].strip()[:200] if lines else ""


def _unfinished(lane: Lane) -> Row:
    last = _log_tail(lane.log)
    status = "NOT FINISHED" if lane.rc == "killed" else f"CRASH rc={lane.rc}"
    return Row(lane.name, f"{lane.name} (whole lane)", status, lane.seconds, last)


# --------------------------------------------------------------------------
# The serve lane: one bad request must not take the server down.
# --------------------------------------------------------------------------


def _post(url: str, body: dict, timeout: float = 60) -> tuple[int, str]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def serve_check(outdir: Path, port: int) -> int:
    from tests.models.tiny_hybrids.checkpoints import build_all

    outdir.mkdir(parents=True, exist_ok=True)
    model = build_all(outdir / "ckpt", ["qwen3_next"])["qwen3_next"]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    cmd = [
        "vllm", "serve", str(model), "--port", str(port),
        "--skip-tokenizer-init", "--kv-cache-dtype", "turboquant_4bit_nc",
        "--kv-cache-memory-bytes", str(256 * 2**20), "--gpu-memory-utilization", "0.1",
        "--max-model-len", "512",
        "--dtype", "float16", "--enforce-eager",
    ]  # fmt: skip
    rows: list[Row] = []
    start = time.time()
    with open(outdir / "server.log", "w") as log:
        server = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            base = f"http://127.0.0.1:{port}"
            while time.time() - start < 300:
                if server.poll() is not None:
                    break
                try:
                    urllib.request.urlopen(f"{base}/health", timeout=2)
                    break
                except (urllib.error.URLError, OSError):
                    time.sleep(2)
            up = server.poll() is None
            rows.append(Row("serve", "server boots", "ok" if up else "FAILED",
                            round(time.time() - start, 1)))  # fmt: skip
            if up:
                url = f"{base}/v1/completions"
                for ids, want in (([10, 20, vocab + 999_999], 400), ([10, -1], 400),
                                  ([10, 20, 30], 200)):  # fmt: skip
                    code, text = _post(
                        url, {"model": str(model), "prompt": ids, "max_tokens": 4}
                    )
                    # A negative id may already fail the request schema.
                    named = "out of vocabulary" in text or min(ids) < 0
                    ok = code == want and (want == 200 or named)
                    rows.append(
                        Row("serve", f"prompt {ids} -> HTTP {want}",
                            "ok" if ok else "FAILED", None,
                            "" if ok else f"HTTP {code}: {text[:160]}")
                    )  # fmt: skip
                alive = server.poll() is None
                rows.append(Row("serve", "server alive after the bad requests",
                                "ok" if alive else "FAILED"))  # fmt: skip
        finally:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    if any(not r.passed for r in rows):
        cause = first_root_cause((outdir / "server.log").read_text(errors="replace"))
        for r in rows:
            if not r.passed and not r.root_cause:
                r.root_cause = cause
    (outdir / "serve.json").write_text(json.dumps([asdict(r) for r in rows]))
    return 0 if all(r.passed for r in rows) else 1


# --------------------------------------------------------------------------
# The suite lane: each GPU test in its own pytest process, a few at a time.
# --------------------------------------------------------------------------


def suite_run(outdir: Path, jobs: int) -> int:
    outdir.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    # Test ids are relative to the root directory; each test's own process
    # must read them against the same one.
    select = ["-m", "gpu", "-p", "no:cacheprovider", f"--rootdir={os.getcwd()}",
              f"--deselect={TQM_TEST}"]  # fmt: skip
    listed = subprocess.run(
        [py, "-m", "pytest", "--collect-only", "-q", *select, *SUITE_PATHS],
        capture_output=True, text=True,
    )  # fmt: skip
    nodes = [ln for ln in listed.stdout.splitlines() if "::" in ln]
    if listed.returncode not in (0, 5):
        print(listed.stdout[-4000:], listed.stderr[-4000:], sep="\n")
        return 1
    (outdir / "nodes.json").write_text(json.dumps(nodes))
    print(f"suite: {len(nodes)} tests, {jobs} at a time", flush=True)
    # A test that hangs fails on its own with its stack (pytest-timeout, in
    # the GPU image), or is stopped here, instead of holding the lane.
    if importlib.util.find_spec("pytest_timeout"):
        select.append(f"--timeout={SUITE_TIMEOUT - 20}")

    # Tests that run at once hold different slots, and each slot its own
    # share of the lane's ports: every test process counts its engines from
    # its base, so with one base their first engines would race for one port.
    jobs = max(1, jobs)
    slots: queue.SimpleQueue[int] = queue.SimpleQueue()
    for slot in range(jobs):
        slots.put(slot)

    def run_one(i: int) -> int:
        slot = slots.get()
        env = dict(os.environ, **share_env(slot, jobs))
        try:
            with open(outdir / f"{i:03d}.log", "w") as log:
                proc = subprocess.Popen(
                    [py, "-m", "pytest", "-v", *select,
                     f"--junitxml={outdir / f'{i:03d}.xml'}", nodes[i]],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    env=env,
                )  # fmt: skip
            try:
                rc = proc.wait(timeout=SUITE_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
        finally:
            slots.put(slot)
        print(f"suite: {nodes[i]} rc={rc}", flush=True)
        return rc

    # Each test is its own group: nothing waits for a leader.
    rcs = run_grouped(range(len(nodes)), lambda i: i, run_one, jobs)
    return 1 if any(rcs) else 0


# --------------------------------------------------------------------------
# Driver.
# --------------------------------------------------------------------------


def gpu_count() -> int:
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


LANES = ("spec", "kernels", "tqm", "suite", "serve")


def kernel_workers() -> list[str]:
    """pytest options that spread tests/kernels over xdist workers, one test
    file to a worker (module fixtures stay whole); none without xdist."""
    if importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(KERNEL_JOBS), "--dist", "loadfile"]


def lanes_for(
    outdir: Path,
    gpus: int,
    jobs: int,
    deadline: float,
    tqm_only: str | None = None,
    chosen: Sequence[str] = LANES,
) -> list[Lane]:
    """The ``chosen`` lanes, each on its GPU: with two or more, the matrix
    alone on the first and the other four on the second; in a call without
    the matrix (a gate in two calls) kernels and suite take the first, so
    the tqm engines do not share a GPU with the kernel tests."""
    py = sys.executable
    other = 1 if gpus > 1 else 0
    tests_gpu = 0 if "spec" not in chosen else other
    # The matrices stop queuing engines early enough to write their tables.
    spec_deadline = str(int(deadline - 30))
    lanes = [
        Lane("spec", [py, "-m", "tests.models.tiny_hybrids.spec_decode_matrix",
                      str(outdir / "spec"), "--gate", "--jobs", str(jobs),
                      "--deadline", spec_deadline, "--timeout", "300"], 0),
        Lane("kernels", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         *kernel_workers(),
                         f"--junitxml={outdir / 'kernels.xml'}", "tests/kernels"],
             tests_gpu),
        Lane("tqm", [py, "-m", "tests.models.tiny_hybrids.turboquant_matrix",
                     str(outdir / "tqm.json"), "--workdir", str(outdir / "tqm"),
                     "--jobs", "8", "--deadline", spec_deadline,
                     *(["--only", tqm_only] if tqm_only else [])], other),
        Lane("suite", [py, "-m", "tests.gpu_gate", "--suite-run",
                       str(outdir / "suite"), "--jobs", str(SUITE_JOBS)], tests_gpu),
        Lane("serve", [py, "-m", "tests.gpu_gate", "--serve-check",
                       str(outdir / "serve"), "--port", "8731"], other),
    ]  # fmt: skip
    return [lane for lane in lanes if lane.name in chosen]


def run_lanes(lanes: list[Lane], outdir: Path, deadline: float, t0: float) -> None:
    for index, lane in enumerate(lanes):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(lane.gpu), PYTHONUNBUFFERED="1")
        env[PORT_BASE_ENV] = lane_base(index)
        lane.log = outdir / f"{lane.name}.log"
        lane.started = time.time()
        with open(lane.log, "w") as log:
            lane.proc = subprocess.Popen(
                lane.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip
    while any(lane.rc is None for lane in lanes):
        for lane in lanes:
            if lane.rc is not None or lane.proc is None:
                continue
            rc = lane.proc.poll()
            if rc is None and time.time() - t0 > deadline:
                os.killpg(lane.proc.pid, signal.SIGKILL)
                lane.proc.wait()
                rc = "killed"
            if rc is not None:
                lane.rc = rc
                lane.seconds = round(time.time() - lane.started, 1)
                print(f"  lane {lane.name}: rc={rc} after {lane.seconds}s", flush=True)
        time.sleep(1)


def host_facts() -> dict[str, str]:
    import importlib.metadata as md

    facts = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        facts["device"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip().replace("\n", ", ")  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        facts["device"] = "?"
    for dist in ("vllm", "torch", "triton", "transformers"):
        try:
            facts[dist] = md.version(dist)
        except md.PackageNotFoundError:
            facts[dist] = "-"
    return facts


def format_table(rows: list[Row]) -> list[str]:
    cols = ("lane", "cell", "status", "s", "first root cause")
    body = [
        (r.lane, r.cell, r.status, "" if r.seconds is None else f"{r.seconds:.0f}",
         r.root_cause if not r.passed or r.status.endswith(" tie") else "")
        for r in rows
    ]  # fmt: skip
    # Long test ids overflow their column rather than widen every row.
    widths = [min(max(len(str(x)) for x in col), 90) for col in zip(cols, *body)]
    widths[-1] = len(cols[-1])
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*cols), *(fmt.format(*b).rstrip() for b in body)]


def summary_md(
    rows: list[Row], facts: dict, lanes: list[Lane], wall: float, partial: bool
) -> str:
    failed = [r for r in rows if not r.passed]
    verdict = "FAIL" if failed else "PARTIAL RUN, no verdict" if partial else "PASS"
    counts = {}
    for r in rows:
        counts.setdefault(r.lane, [0, 0])
        counts[r.lane][0 if r.passed else 1] += 1
    out = [
        f"# GPU gate: vllm {facts['vllm']} — {verdict}",
        "",
        f"- date: {facts['date']}; device: {facts['device']}",
        f"- torch {facts['torch']}, triton {facts['triton']}, "
        f"transformers {facts['transformers']}",
        f"- command: `{facts.get('command', 'bash scripts/gpu-gate.sh')}`",
        f"- wall: {wall:.0f} s; lanes: "
        + ", ".join(
            f"{ln.name} on GPU {ln.gpu} {ln.seconds} s (rc {ln.rc})" for ln in lanes
        ),
        "- cells passed / failed per lane: "
        + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in counts.items()),
        *out_of_time(rows),
        "",
        "```",
        *format_table(shown_rows(rows)),
        "```",
        "",
    ]
    return "\n".join(out)


def out_of_time(rows: list[Row]) -> list[str]:
    """The record's line for a run the deadline cut short: which cells it
    left and what to do, since a host slower than the gate's one-call budget
    cuts cells that did not fail."""
    cut = [r for r in rows if r.status == "NOT FINISHED" or NOT_RUN in r.root_cause]
    if not cut:
        return []
    return [
        f"- out of time: the deadline left {len(cut)} cell(s) not run or not "
        "finished on this host ("
        + ", ".join(f"{r.lane} {r.cell}" for r in cut[:4])
        + (", ..." if len(cut) > 4 else "")
        + "), and cells running then stop as TIMEOUT; a cut cell is not a "
        "verdict on it. Run the gate in two calls, `--lanes spec` and then "
        "`--lanes kernels,tqm,suite,serve`, and `--combine` them (README, GPU "
        "gate)"
    ]


# Lanes of many pytest cases: their passing cases are one row each in
# gate.json, and one row of counts in the table.
COUNTED_LANES = ("kernels", "suite")


def shown_rows(rows: list[Row]) -> list[Row]:
    shown: list[Row] = []
    for lane in dict.fromkeys(r.lane for r in rows):
        mine = [r for r in rows if r.lane == lane]
        if lane not in COUNTED_LANES:
            shown += mine
            continue
        ok = [r for r in mine if r.passed]
        if ok:
            n = {s: sum(r.status == s for r in ok) for s in ("passed", "skipped")}
            secs = sum(r.seconds or 0 for r in ok)
            cell = f"{n['passed']} passed, {n['skipped']} skipped"
            shown.append(Row(lane, cell, "passed", secs))
        shown += [r for r in mine if not r.passed]
    return shown


# A run's folder as it stays: the record and one archive of what the lanes
# wrote (logs, results, reports). The checkpoints they built and their work
# folders are removed (a device call brings back at most 8 files of under
# 16 MiB each; a run leaves hundreds of megabytes in dozens), unless
# --keep-work.
KEPT = ("gate.md", "gate.json", "logs.tar.gz")
ARCHIVED_SUFFIXES = (".log", ".json", ".xml", ".md", ".txt", ".gz")
ARCHIVED_MAX_BYTES = 4 * 2**20


def pack_outputs(outdir: Path, keep_work: bool = False) -> None:
    """Archive the lanes' logs and results as OUTDIR/logs.tar.gz (files of
    ``ARCHIVED_SUFFIXES`` up to ``ARCHIVED_MAX_BYTES``, none from a
    checkpoint folder), written whole or not at all; then, unless
    ``keep_work``, remove everything in OUTDIR but ``KEPT``."""
    checkpoints = {p.parent for p in outdir.rglob("*.safetensors")}
    archived = [
        p
        for p in sorted(outdir.rglob("*"))
        if p.is_file()
        and str(p.relative_to(outdir)) not in KEPT
        and p.suffix in ARCHIVED_SUFFIXES
        and p.stat().st_size <= ARCHIVED_MAX_BYTES
        and not any(parent in checkpoints for parent in p.parents)
    ]
    tmp = outdir / "logs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for p in archived:
            tar.add(p, arcname=str(p.relative_to(outdir)))
    os.replace(tmp, outdir / "logs.tar.gz")
    if keep_work:
        return
    for child in outdir.iterdir():
        if child.name in KEPT:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def write_record(
    outdir: Path,
    rows: list[Row],
    facts: dict,
    lanes: list[Lane],
    wall: float,
    partial: bool,
    **extra,
) -> int:
    """Write OUTDIR/gate.md and gate.json, print the summary and return the
    exit status: 0 only for a whole run whose every cell passed."""
    md = summary_md(rows, facts, lanes, wall, partial)
    (outdir / "gate.md").write_text(md)
    (outdir / "gate.json").write_text(
        json.dumps(
            {"facts": facts, "wall": wall, **extra,
             "rows": [asdict(r) for r in rows],
             "lanes": [{"name": ln.name, "gpu": ln.gpu, "rc": ln.rc,
                        "seconds": ln.seconds} for ln in lanes]},
            indent=1,
        )
    )  # fmt: skip
    print(md)
    return 0 if all(r.passed for r in rows) and not partial else 1


def combine(outdir: Path, parts: list[Path]) -> int:
    """One gate record from runs of the same release that each ran some of
    the lanes (``--lanes``), every lane once: a host with one GPU runs
    ``spec`` in one device call and the other four in the next, because all
    five on one GPU outlast a call. Writes OUTDIR/gate.md and gate.json as a
    whole run does; returns the exit status (2: parts that do not combine).
    """
    runs = []
    for part in parts:
        path = part / "gate.json"
        try:
            runs.append((part, json.loads(path.read_text())))
        except (OSError, ValueError) as e:
            print(f"gpu-gate --combine: {path} is not a gate run's record ({e}); "
                  "pass the directories gpu-gate.sh wrote ($OUT/gate)",
                  file=sys.stderr)  # fmt: skip
            return 2
    for key in ("vllm", "torch", "triton", "transformers"):
        seen = {run["facts"].get(key) for _, run in runs}
        if len(seen) > 1:
            print(f"gpu-gate --combine: the parts ran different {key} versions "
                  f"({', '.join(sorted(map(str, seen)))}); a gate record is one "
                  "release on one runtime: rerun the lanes of the other",
                  file=sys.stderr)  # fmt: skip
            return 2
    devices = {name for _, run in runs for name in run["facts"]["device"].split(", ")}
    if len(devices) > 1:
        print(f"gpu-gate --combine: the parts ran on different GPUs "
              f"({', '.join(sorted(devices))}); combine runs of one GPU model",
              file=sys.stderr)  # fmt: skip
        return 2
    ran: dict[str, Path] = {}
    for part, run in runs:
        for lane in run["lanes"]:
            if lane["name"] in ran:
                print(f"gpu-gate --combine: lane {lane['name']} ran in both "
                      f"{ran[lane['name']]} and {part}; each lane counts once: "
                      "leave one of them out", file=sys.stderr)  # fmt: skip
                return 2
            ran[lane["name"]] = part
    rows = [Row(**row) for _, run in runs for row in run["rows"]]
    lanes = [
        Lane(ln["name"], [], ln["gpu"], seconds=ln["seconds"], rc=ln["rc"])
        for _, run in runs
        for ln in run["lanes"]
    ]
    first = runs[0][1]["facts"]
    facts = dict(
        first,
        date=" and ".join(run["facts"]["date"] for _, run in runs),
        # summary_md quotes the command: each part's in its own quotes.
        command="` then `".join(run["facts"]["command"] for _, run in runs),
    )
    wall = sum(run["wall"] for _, run in runs)
    partial = set(ran) != set(LANES)
    outdir.mkdir(parents=True, exist_ok=True)
    parts_ran = [str(p) for p, _ in runs]
    return write_record(outdir, rows, facts, lanes, wall, partial, parts=parts_ran)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.gpu_gate", description=__doc__)
    p.add_argument("outdir", type=Path)
    p.add_argument("--deadline", type=float, default=510,
                   help="seconds for the whole gate (default 510)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=8,
                   help="matrix engines at a time (default 8)")  # fmt: skip
    p.add_argument("--lanes", default=",".join(LANES),
                   help="lanes to run, comma-separated (default all: the gate); "
                   "fewer make a partial run, which never reports PASS")  # fmt: skip
    p.add_argument("--tqm-only", default=None,
                   help="tqm lane: only rows whose name contains this")  # fmt: skip
    p.add_argument("--combine", nargs="+", type=Path, default=None,
                   metavar="PART",
                   help="write one record from earlier runs' OUTDIRs, each "
                   "with some lanes, every lane once (a one-GPU host: "
                   "--lanes spec, then the other four)")  # fmt: skip
    p.add_argument("--keep-work", action="store_true",
                   help="keep the lanes' checkpoints and work folders in "
                   "OUTDIR (default: only gate.md, gate.json and logs.tar.gz "
                   "stay)")  # fmt: skip
    p.add_argument("--serve-check", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--suite-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=8731, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_check:
        return serve_check(args.outdir, args.port)
    if args.suite_run:
        return suite_run(args.outdir, args.jobs)
    if args.combine:
        return combine(args.outdir, args.combine)
    if args.deadline < 120 or args.jobs < 1:
        p.error("--deadline must be >= 120 seconds and --jobs >= 1")
    chosen = args.lanes.split(",")
    unknown = sorted(set(chosen) - set(LANES))
    if unknown or not chosen:
        p.error(f"--lanes: unknown {unknown}; the lanes are {', '.join(LANES)}")
    partial = set(chosen) != set(LANES) or args.tqm_only is not None
    gpus = gpu_count()
    if gpus == 0:
        print("gpu-gate: no CUDA GPU here (nvidia-smi -L lists none); the gate "
              "runs on the GPU host", file=sys.stderr)  # fmt: skip
        return 2
    args.outdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    lanes = lanes_for(
        args.outdir, gpus, args.jobs, args.deadline, args.tqm_only, chosen
    )
    print(f"gpu-gate: {gpus} GPU(s), deadline {args.deadline:.0f}s", flush=True)
    if gpus == 1 and not partial:
        print("gpu-gate: one GPU: spec alone took 406 s and the other four "
              "lanes 345 s on an H200; where a call is shorter than both, run "
              "--lanes spec and --lanes kernels,tqm,suite,serve in two calls and "
              "--combine their OUTDIRs", flush=True)  # fmt: skip
    run_lanes(lanes, args.outdir, args.deadline, t0)
    readers = {
        "spec": lambda lane: spec_rows(args.outdir / "spec" / "matrix.json", lane),
        "kernels": lambda lane: junit_rows(args.outdir / "kernels.xml", lane),
        "tqm": lambda lane: tqm_rows(args.outdir / "tqm.json", lane),
        "suite": lambda lane: suite_rows(args.outdir / "suite", lane),
        "serve": lambda lane: serve_rows(args.outdir / "serve" / "serve.json", lane),
    }
    rows = [row for lane in lanes for row in readers[lane.name](lane)]
    wall = time.time() - t0
    facts = host_facts()
    given = [a for a in (argv or sys.argv[1:]) if a != str(args.outdir)]
    facts["command"] = " ".join(["bash scripts/gpu-gate.sh", *given])
    rc = write_record(args.outdir, rows, facts, lanes, wall, partial)
    pack_outputs(args.outdir, args.keep_work)
    return rc


if __name__ == "__main__":
    sys.exit(main())
