"""Build the patched wheel: the pristine PyPI wheel, with the series applied.

Only the files the series writes change; every other member is copied as it
is. The distribution is renamed to the local version ``X.Y.Z+hybridkv.N`` so
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
