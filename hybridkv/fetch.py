"""Fetch the pristine vLLM wheel and sdist from PyPI and unpack them.

PyPI's JSON simple API (PEP 691) gives each file's URL and sha256 without
pip trying to build the sdist (which fails without CUDA). Only files whose
sha256 is pinned in requirements/vllm-base.txt are accepted.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import urllib.request
import zipfile
from pathlib import Path

from hybridkv.base import (
    Base,
    downloads_dir,
    load_base,
    pristine_wheel_dir,
    upstream_tests_dir,
)

INDEX = "https://pypi.org/simple"
WHEEL_PLATFORM = "manylinux_2_35_x86_64"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _index_files(project: str) -> list[dict]:
    req = urllib.request.Request(
        f"{INDEX}/{project}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["files"]


def _wanted(base: Base, name: str) -> bool:
    stem = f"{base.project}-{base.version}"
    return name == f"{stem}.tar.gz" or (
        name.startswith(f"{stem}-") and name.endswith(f"{WHEEL_PLATFORM}.whl")
    )


def _download(url: str, dest: Path, sha256: str) -> None:
    tmp = dest.with_suffix(dest.suffix + ".part")
    with urllib.request.urlopen(url, timeout=600) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f, 1 << 20)
    got = sha256_of(tmp)
    if got != sha256:
        tmp.unlink()
        raise SystemExit(
            f"{dest.name}: sha256 {got} does not match the pinned {sha256} "
            "(requirements/vllm-base.txt). Refusing a file that is not the pinned base."
        )
    tmp.replace(dest)


def fetch(log=print) -> dict[str, Path]:
    """Download (once) and verify the pinned wheel and sdist; return their paths."""
    base = load_base()
    dl = downloads_dir()
    dl.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    listing = None
    for kind in ("wheel", "sdist"):
        cached = [
            p for p in dl.glob(f"{base.project}-{base.version}*")
            if _wanted(base, p.name) and (p.suffix == ".whl") == (kind == "wheel")
        ]
        if cached and sha256_of(cached[0]) in base.sha256:
            files[kind] = cached[0]
            log(f"cached   {cached[0].name}")
            continue
        if listing is None:
            listing = [f for f in _index_files(base.project) if _wanted(base, f["filename"])]
        match = [
            f for f in listing
            if (f["filename"].endswith(".whl")) == (kind == "wheel")
            and f["hashes"].get("sha256") in base.sha256
        ]
        if not match:
            raise SystemExit(
                f"PyPI lists no {kind} of {base.project}=={base.version} for "
                f"{WHEEL_PLATFORM} with a sha256 pinned in requirements/vllm-base.txt."
            )
        dest = dl / match[0]["filename"]
        log(f"download {dest.name}")
        _download(match[0]["url"], dest, match[0]["hashes"]["sha256"])
        files[kind] = dest
    return files


def _unpack_once(dest: Path, source: Path, extract, log) -> None:
    """Run ``extract(dest)`` unless ``dest`` already holds ``source``'s contents."""
    stamp = dest / ".from"
    if stamp.exists() and stamp.read_text() == source.name:
        return
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    extract(dest)
    stamp.write_text(source.name)
    log(f"unpacked {source.name} -> {dest}")


def _extract_sdist_tests(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as t:
        root = t.getmembers()[0].name.split("/")[0]
        keep = [
            m for m in t.getmembers()
            if m.name.startswith(f"{root}/tests/") or m.name == f"{root}/pyproject.toml"
        ]
        for m in keep:
            m.name = m.name[len(root) + 1:]
        t.extractall(dest, members=keep, filter="data")


def _extract_wheel(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest)


def unpack(files: dict[str, Path], log=print) -> None:
    """Unpack the wheel (the pristine tree) and the sdist's tests/ (once)."""
    _unpack_once(pristine_wheel_dir(), files["wheel"],
                 lambda d: _extract_wheel(files["wheel"], d), log)
    _unpack_once(upstream_tests_dir(), files["sdist"],
                 lambda d: _extract_sdist_tests(files["sdist"], d), log)
