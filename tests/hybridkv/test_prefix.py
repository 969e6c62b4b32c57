# SPDX-License-Identifier: Apache-2.0
"""`hybridkv prefix-test`: each patch's tests at its own place in the series."""

from hybridkv.patchfile import apply_hunks, join_lines, read_lines
from hybridkv.prefix import prefix_tree


def test_prefix_tree_holds_exactly_the_first_n_patches(tmp_path, pristine_root, series):
    first = series.patches[0]
    tree = prefix_tree(series, 1, tmp_path / "tree")
    for d in first.diffs:
        want = apply_hunks(read_lines(pristine_root / d.path), d.hunks)
        assert not (tree / d.path).is_symlink()
        assert (tree / d.path).read_bytes() == join_lines(want)
    for rel in first.listed("Overlay"):
        assert (tree / rel).read_bytes() == (series.repo / rel).read_bytes()
    later = [rel for p in series.patches[1:] for rel in p.listed("Overlay")]
    assert later and not any((tree / rel).exists() for rel in later)
    # Everything else is the pristine file, linked rather than copied.
    assert (tree / "vllm" / "__init__.py").resolve() == (
        pristine_root / "vllm" / "__init__.py"
    ).resolve()
    assert next(tree.glob("vllm-*.dist-info")).is_dir()
