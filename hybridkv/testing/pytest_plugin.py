"""pytest plugin: run vLLM 0.20.2's CPU-runnable unit tests and ours on a GPU-less box.

Load it with ``-p hybridkv.testing.pytest_plugin``. Where CUDA GPUs are visible
it only registers markers, fixtures and options, and changes nothing else.
Without CUDA, before any conftest (and so before vLLM) is imported, it:

- sets ``HF_HUB_OFFLINE=1`` (setdefault): there is no hub, and ``ModelConfig``
  with a hub id otherwise retries for >10 min instead of failing;
- sets ``HYBRIDKV_TEST_PLATFORM=cpu`` (setdefault) so the
  ``hybridkv.testing.cpu_platform`` entry point selects vLLM's CpuPlatform
  (also in subprocesses, which inherit the variable). If that entry point is
  not installed (or filtered out by ``VLLM_PLUGINS``) it sets
  ``vllm.platforms._current_platform`` to CpuPlatform directly instead
  (this process only);
- makes ``import vllm.platforms.rocm`` raise ImportError: without a GPU it
  raises AssertionError/RuntimeError, which slips past the tests'
  ``except ImportError`` guards and errors whole files at collection;
- turns ``torch.accelerator.empty_cache()`` into a no-op when there is no
  accelerator: CPU torch raises "Cannot access accelerator device" there, and
  vLLM's teardown (cleanup_dist_env_and_memory) calls it whenever the platform
  is not CPU (e.g. a test that swaps ``current_platform`` for a mock).

On a CPU run it also lightens vLLM's per-test teardown (``cleanup_fixture`` in
its tests/conftest.py, autouse): that calls ``cleanup_dist_env_and_memory()``,
whose full ``gc.collect()`` walks every object vLLM, torch and transformers
left on the heap, ~0.4 s a test: over 90 % of the time of vLLM's own tests here.
Each test in that fixture's reach is marked ``skip_global_cleanup`` (vLLM's
own switch for GPU-less unit tests) and the plugin's teardown does the rest of
that cleanup (environment cache, model-parallel groups, distributed
environment); only the forced collection and the GPU caches' release, which
have nothing to free without a GPU, are left out. ``--full-cleanup`` restores
vLLM's teardown as written.

Triton on CPU (opt-in, ``HYBRIDKV_TRITON_INTERPRET=1`` or ``--triton-interpret``):
Triton picks its interpreter when a ``@triton.jit`` kernel is *defined*, and
vLLM replaces Triton by a placeholder at ``vllm.triton_utils`` import unless
``CUDA_VISIBLE_DEVICES`` is empty, so ``TRITON_INTERPRET=1`` and
``CUDA_VISIBLE_DEVICES=""`` must be set before triton/vLLM are imported. The
plugin sets both in ``pytest_load_initial_conftests`` (runs before conftests are
imported), which hides any GPU: the run is then a CPU run. Tests ask for it
with the ``triton_interpret`` fixture or marker (skipped, with the reason, when
the interpreter is not active) or the ``triton_device`` fixture ("cuda" on a
GPU, "cpu" under the interpreter, else skipped). Use fp32 under the
interpreter (bf16 gives wrong results/NaN there) and small shapes. The plugin
also has the interpreter patch triton.language once a launch
(``hybridkv.testing.triton_interpreter``) and, when ``HYBRIDKV_INTERPRET_MEMO``
names a folder, reuse launches that recur exactly, there and in other processes
given the same folder (``hybridkv.testing.interpreter_memo``).
"""

import importlib.abc
import os
import sys

import pytest

PLATFORM_ENV = "HYBRIDKV_TEST_PLATFORM"
INTERPRET_ENV = "HYBRIDKV_TRITON_INTERPRET"
# A folder: interpreter launches that recur exactly are read back from it
# (hybridkv.testing.interpreter_memo).
MEMO_ENV = "HYBRIDKV_INTERPRET_MEMO"
_ENTRY_POINT_MODULE = "hybridkv.testing.cpu_platform"
_TRUE = {"1", "true", "yes", "on"}
# The commit the stand-in hub cache says `main` points at (any 40 hex digits).
_STAND_IN_COMMIT = "0" * 40

# vLLM's autouse teardown fixture (tests/conftest.py), which the plugin lightens
# on a CPU run; see the module docstring.
_UPSTREAM_CLEANUP = "cleanup_fixture"
# Set on the tests the plugin lightened, not on those vLLM marks itself.
_LIGHTENED = pytest.StashKey[bool]()

# Filled by _setup(); read by hooks and fixtures.
_state: dict = {"done": False, "cuda": False, "interpret_error": None}


def pytest_addoption(parser):
    parser.getgroup("hybridkv").addoption(
        "--triton-interpret",
        action="store_true",
        default=False,
        help="run Triton kernels with the Triton CPU interpreter "
        f"(same as {INTERPRET_ENV}=1; hides GPUs)",
    )
    parser.getgroup("hybridkv").addoption(
        "--full-cleanup",
        action="store_true",
        default=False,
        help="keep vLLM's per-test teardown as written on a CPU run, with its "
        "full gc.collect() (~0.4 s a test)",
    )
    parser.getgroup("hybridkv").addoption(
        "--model-redirect-dir",
        default=None,
        metavar="DIR",
        help="serve hub ids from config-only directories DIR/<org>/<name> (through "
        "vLLM's VLLM_MODEL_REDIRECT_PATH and a temporary HF_HUB_CACHE), so tests "
        "that build ModelConfig or EngineArgs from a hub id run offline. Write "
        "--model-redirect-dir=DIR.",
    )
    parser.getgroup("hybridkv").addoption(
        "--deselect-file",
        action="append",
        default=[],
        metavar="PATH",
        help="deselect the node ids listed in PATH, one a line, with their "
        "[parametrizations] ('#' comments allowed). May repeat. On the command "
        "line write --deselect-file=PATH: pytest picks its rootdir before plugin "
        "options are known and would take a separate PATH for a test path.",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # Earliest hook that sees parsed options and still runs before conftest.py
    # files (vLLM's tests/conftest.py imports vllm) are imported.
    _setup(early_config)


def pytest_configure(config):
    _setup(config)  # no-op if done; covers loading via a conftest's pytest_plugins
    if "--deselect-file" in config.invocation_params.args:
        # The separate PATH already moved the rootdir (and ini file) above it.
        raise pytest.UsageError("write --deselect-file=PATH (with '=')")
    for line in (
        "gpu: needs a CUDA GPU; skipped when torch.cuda.device_count() == 0",
        "cpu_test: runs on CPU only (no GPU needed)",
        "triton_interpret: runs Triton kernels; skipped unless the Triton CPU "
        f"interpreter is active ({INTERPRET_ENV}=1 / --triton-interpret)",
        "skip_global_cleanup: vLLM's; no cleanup_dist_env_and_memory() after "
        "the test (the plugin sets it on a CPU run, see --full-cleanup)",
    ):
        config.addinivalue_line("markers", line)


def _setup(config) -> None:
    if _state["done"]:
        return
    _state["done"] = True

    # In pytest_load_initial_conftests options are only in known_args_namespace.
    opts = getattr(config, "known_args_namespace", None) or config.option
    if os.environ.get(INTERPRET_ENV, "").strip().lower() in _TRUE or getattr(
        opts, "triton_interpret", False
    ):
        late = sorted(m for m in ("triton", "vllm") if m in sys.modules)
        if late:
            _state["interpret_error"] = (
                f"{' and '.join(late)} imported before the hybridkv plugin could set "
                "TRITON_INTERPRET=1 / CUDA_VISIBLE_DEVICES='' (load the plugin with -p)"
            )
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        from hybridkv.testing import triton_interpreter

        triton_interpreter.install()
        memo = os.environ.get(MEMO_ENV, "").strip()
        if memo:
            from hybridkv.testing import interpreter_memo

            _state["memo"] = interpreter_memo.install(memo)

    redirect_dir = getattr(opts, "model_redirect_dir", None)
    if redirect_dir:
        _redirect_models(config, redirect_dir)

    import torch

    # device_count(), not is_available(): it asks NVML, so it does not
    # initialise CUDA in this process and poison later fork()s of GPU tests.
    _state["cuda"] = torch.cuda.device_count() > 0
    if _state["cuda"]:
        return  # real GPU run: change nothing
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault(PLATFORM_ENV, "cpu")
    if os.environ[PLATFORM_ENV].strip().lower() == "cpu" and not _entry_point_active():
        import vllm.platforms

        from hybridkv.testing.cpu_test_platform import CpuTestPlatform

        if vllm.platforms._current_platform is None:
            vllm.platforms._current_platform = CpuTestPlatform()

    if getattr(torch.version, "hip", None) is None:
        sys.meta_path.insert(0, _BlockRocmPlatform())

    if not torch.accelerator.is_available():
        torch.accelerator.empty_cache = lambda: None


def _redirect_models(config, root: str) -> None:
    """Point vLLM's model redirect at every DIR/<org>/<name>/config.json.

    The map and the stand-in hub cache last as long as ``config``'s session:
    left behind, every run of the upstream tests added two more to TMPDIR."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    base = Path(root).resolve()
    mapping = {
        str(cfg.parent.relative_to(base)): str(cfg.parent)
        for cfg in sorted(base.glob("*/*/config.json"))
    }
    fd, path = tempfile.mkstemp(prefix="hybridkv-model-redirect-", suffix=".json")
    config.add_cleanup(lambda: Path(path).unlink(missing_ok=True))
    with os.fdopen(fd, "w") as f:
        json.dump(mapping, f)
    os.environ["VLLM_MODEL_REDIRECT_PATH"] = path
    # EngineArgs resolves the hub id before ModelConfig applies the redirect:
    # with HF_HUB_OFFLINE it asks the hub cache (snapshot_download,
    # local_files_only). A cache holding the same directories answers it.
    cache = Path(tempfile.mkdtemp(prefix="hybridkv-hub-cache-"))
    config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    for repo_id, folder in mapping.items():
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo / "snapshots" / _STAND_IN_COMMIT
        snapshot.mkdir(parents=True)
        for file in Path(folder).iterdir():
            (snapshot / file.name).symlink_to(file)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(_STAND_IN_COMMIT)
    os.environ["HF_HUB_CACHE"] = str(cache)
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].constants.HF_HUB_CACHE = str(cache)


def _entry_point_active() -> bool:
    """True if vLLM will load our vllm.platform_plugins entry point."""
    from importlib.metadata import entry_points

    allowed = os.environ.get("VLLM_PLUGINS")  # vLLM: comma-separated allow-list
    allowed = None if allowed is None else allowed.split(",")
    return any(
        ep.value.split(":")[0] == _ENTRY_POINT_MODULE
        and (allowed is None or ep.name in allowed)
        for ep in entry_points(group="vllm.platform_plugins")
    )


class _BlockRocmPlatform(importlib.abc.MetaPathFinder):
    """Make ``import vllm.platforms.rocm`` a clean ImportError on non-ROCm boxes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "vllm.platforms.rocm":
            raise ImportError(
                "vllm.platforms.rocm blocked by hybridkv.testing: no ROCm here",
                name=fullname,
            )
        return None


def pytest_collection_modifyitems(config, items):
    # A file of node ids (e.g. upstream tests that need the HF hub), so CI keeps
    # one reviewed list instead of a long --deselect command line. An entry
    # matches that node, its parametrizations ("id[...]"), its children
    # ("id::..."), or, ending in "/", a directory; unlike --deselect it does not
    # match "test_foo_bar" for "test_foo".
    ids = []
    for path in config.getoption("deselect_file"):
        with open(path) as f:
            lines = (line.split("#", 1)[0].strip() for line in f)
            ids += [line for line in lines if line]
    heads = tuple(
        h for i in ids for h in ((i,) if i.endswith("/") else (i + "[", i + "::"))
    )
    exact = set(ids)

    def dropped(item):
        return item.nodeid in exact or (heads and item.nodeid.startswith(heads))

    gone = [i for i in items if dropped(i)]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = [i for i in items if not dropped(i)]

    if not _state["cuda"] and not config.getoption("full_cleanup"):
        light = pytest.mark.skip_global_cleanup
        for item in items:
            if _UPSTREAM_CLEANUP in getattr(
                item, "fixturenames", ()
            ) and not item.get_closest_marker("skip_global_cleanup"):
                item.add_marker(light)
                item.stash[_LIGHTENED] = True

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.device_count()=0)")
    interp = [i for i in items if i.get_closest_marker("triton_interpret")]
    problem = _interpreter_problem() if interp else None
    for item in items:
        if item.get_closest_marker("gpu") and not _state["cuda"]:
            item.add_marker(no_gpu)
    for item in interp if problem else ():
        item.add_marker(pytest.mark.skip(reason=problem))


def _interpreter_problem() -> str | None:
    """Why the Triton CPU interpreter is not usable, or None if it is."""
    if (
        os.environ.get("TRITON_INTERPRET") != "1"
        or os.environ.get("CUDA_VISIBLE_DEVICES") != ""
    ):
        return (
            "Triton CPU interpreter not active: run pytest with "
            f"{INTERPRET_ENV}=1 or --triton-interpret (TRITON_INTERPRET=1 and "
            "CUDA_VISIBLE_DEVICES='' must be set before triton/vllm are imported)"
        )
    if _state["interpret_error"]:
        return "Triton CPU interpreter not active: " + _state["interpret_error"]
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError as e:
        return f"Triton CPU interpreter not usable: {e}"
    if not HAS_TRITON:
        return "Triton CPU interpreter not usable: vLLM disabled Triton (placeholder)"
    return None


def _require_interpreter() -> None:
    problem = _interpreter_problem()
    if problem:
        pytest.skip(problem)


@pytest.fixture
def triton_interpret() -> str:
    """Device ("cpu") for Triton kernels under the CPU interpreter; skips otherwise."""
    _require_interpreter()
    return "cpu"


@pytest.fixture
def triton_device() -> str:
    """Triton kernel device: "cuda" on a GPU, "cpu" under the interpreter, else skip."""
    if _state["cuda"]:
        return "cuda"
    _require_interpreter()
    return "cpu"


@pytest.fixture(autouse=True)
def _cleanup_without_a_full_collection(request):
    yield
    if not request.node.stash.get(_LIGHTENED, False):
        return
    from vllm import envs
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    envs.disable_envs_cache()
    destroy_model_parallel()
    destroy_distributed_environment()


def pytest_terminal_summary(terminalreporter):
    if _state.get("memo"):
        from hybridkv.testing.interpreter_memo import stats

        terminalreporter.write_line(
            f"Triton interpreter launches: {stats['run']} run, {stats['reused']} "
            f"read back from ${MEMO_ENV}"
        )
