"""Build the patched wheel: the pristine PyPI wheel, with the series applied.

Only the files the series writes change; every other member is copied as it
is, except the METADATA: version label, and the requirements listed in
``requirements/wheel-requires.txt`` (so that pip resolves a set that runs). The distribution is renamed to the local version ``X.Y.Z+hybridkv.N`` so
``pip`` and ``importlib.metadata`` tell a patched install from a pristine one.
"""

from __future__ import annotations

import csv
import io
import re
import zipfile
from pathlib import Path

from hybridkv.base import REPO, load_base, pristine_wheel_dir
from hybridkv.series import Series
from hybridkv.tree import plan, record_hash, rendered_files

VERSION_FILE = "vllm/_version.py"
REQUIRES_FILE = REPO / "requirements" / "wheel-requires.txt"


def _project(requirement: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not m:
        raise SystemExit(f"{REQUIRES_FILE.name}: not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def load_requires(path: Path = REQUIRES_FILE) -> dict[str, str]:
    """Normalized project name -> the requirement line that replaces pristine's."""
    lines = [ln.split(" #")[0].strip() for ln in path.read_text().splitlines()]
    return {_project(ln): ln for ln in lines if ln and not ln.startswith("#")}


def steer_requirements(metadata: bytes, requires: dict[str, str]) -> bytes:
    """Replace the pristine ``Requires-Dist`` line of each project in ``requires``.

    Only lines without an ``extra ==`` marker are replaced (extras keep their
    own pins). A project pristine does not require means the base drifted.
    """
    text = metadata.decode()
    seen: set[str] = set()

    def swap(m: re.Match) -> str:
        requirement = m.group(1)
        name = _project(requirement)
        if name not in requires or "extra ==" in requirement:
            return m.group(0)
        seen.add(name)
        return f"Requires-Dist: {requires[name]}"

    text = re.sub(r"^Requires-Dist: (.*)$", swap, text, flags=re.M)
    missing = sorted(set(requires) - seen)
    if missing:
        raise SystemExit(
            f"{REQUIRES_FILE.name}: the pristine METADATA has no Requires-Dist for "
            f"{', '.join(missing)}; remove them there or check the base."
        )
    return text.encode()


def _relabel_version_file(text: str, label: str) -> str:
    # vcs-versioning's generated file: `vllm --version` should show the label too.
    return re.sub(
        r"^(__version__ = version = )'[^']*'", rf"\g<1>'{label}'", text, count=1, flags=re.M
    )


def build(pristine_whl: Path, series: Series, out_dir: Path = REPO / "dist", log=print) -> Path:
    base = load_base()
    pl = plan(pristine_wheel_dir(), series, base)
    if not pl.ok:
        raise SystemExit("the series does not apply to the pristine wheel; run `hybridkv check`")
    files = rendered_files(pl, series, base)
    old_info = f"{base.project}-{base.version}.dist-info"
    new_info = f"{base.project}-{base.label}.dist-info"
    out_dir.mkdir(parents=True, exist_ok=True)
    tags = pristine_whl.name[len(f"{base.project}-{base.version}-"):]
    target = out_dir / f"{base.project}-{base.label}-{tags}"
    tmp = target.with_suffix(".tmp")
    record_rows: list[list[str]] = []
    with zipfile.ZipFile(pristine_whl) as src, zipfile.ZipFile(
        tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1
    ) as dst:
        for info in src.infolist():
            name = info.filename
            if name == f"{old_info}/RECORD":
                continue
            data = src.read(name)
            if name in files:
                data = files.pop(name)
            elif name == VERSION_FILE:
                data = _relabel_version_file(data.decode(), base.label).encode()
            elif name == f"{old_info}/METADATA":
                data = re.sub(
                    rb"^Version: .*$", f"Version: {base.label}".encode(), data, count=1, flags=re.M
                )
                data = steer_requirements(data, load_requires())
            if name.startswith(old_info + "/"):
                name = new_info + name[len(old_info):]
            _write(dst, info, name, data)
            record_rows.append([name, record_hash(data), str(len(data))])
        for name, data in sorted(files.items()):  # new files: overlay and manifest
            _write(dst, zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0)), name, data)
            record_rows.append([name, record_hash(data), str(len(data))])
        record_rows.append([f"{new_info}/RECORD", "", ""])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(record_rows)
        _write(dst, zipfile.ZipInfo(f"{new_info}/RECORD", date_time=(2026, 1, 1, 0, 0, 0)),
               f"{new_info}/RECORD", buf.getvalue().encode())
    tmp.replace(target)
    log(f"built {target} ({target.stat().st_size / 2**20:.0f} MiB): "
        f"{len(series.patches)} patches, {len(pl.overlay)} overlay files")
    return target


def _write(dst: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, data: bytes) -> None:
    new = zipfile.ZipInfo(name, date_time=info.date_time)
    new.external_attr = info.external_attr or (0o644 << 16)
    new.compress_type = zipfile.ZIP_DEFLATED
    dst.writestr(new, data, compresslevel=1)
