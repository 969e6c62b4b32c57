# SPDX-License-Identifier: Apache-2.0
"""hybridkv.testing.triton_interpreter: triton.language patched once a launch.

Each case runs in a child process (``interpreter_child``).
"""

import textwrap

import pytest

from tests.hybridkv.interpreter_child import run_interpreted

CHILD = textwrap.dedent(
    """
    import json, sys

    import torch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as itp

    from hybridkv.testing import triton_interpreter

    @triton.jit
    def _scaled(x, s):
        return tl.math.exp(x) * s

    @triton.jit
    def _kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)
        for _ in range(3):
            x = _scaled(x, 0.5)
        tl.store(out_ptr + offs, x)

    walks = 0
    builtin = itp._patch_builtin

    def counting(*args, **kwargs):
        global walks
        walks += 1
        return builtin(*args, **kwargs)

    itp._patch_builtin = counting

    def run(programs):
        global walks
        x = torch.linspace(-1, 1, 16 * programs)
        out = torch.empty_like(x)
        walks = 0
        _kernel[(programs,)](x, out, BLOCK=16)
        want = x.double()
        for _ in range(3):
            want = want.exp() * 0.5
        return walks, (out.double() - want).abs().max().item()

    installed = sys.argv[1] == "on" and triton_interpreter.install()
    again = triton_interpreter.install() if installed else None
    original = tl.program_id
    one, err_one = run(1)
    eight, err_eight = run(8)
    print(json.dumps({
        "installed": installed, "again": again,
        "walks": [one, eight], "err": max(err_one, err_eight),
        "restored": tl.program_id is original,
    }))
    """
)


def _child(tmp_path, mode: str) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return run_interpreted(script, mode, timeout=120)


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("interp")
    return {mode: _child(tmp, mode) for mode in ("off", "on")}


def test_a_launch_walks_the_language_once_however_many_programs_call(children):
    on, off = children["on"], children["off"]
    assert on["installed"] is True and on["again"] is True
    one, eight = on["walks"]
    assert one == eight, on
    # Triton as shipped walks again at each of the 3 device calls of a program.
    assert off["walks"][1] > off["walks"][0] > one, (off, on)


def test_values_and_the_restored_language_are_triton_s_own(children):
    for mode in ("off", "on"):
        child = children[mode]
        assert child["err"] < 1e-5, (mode, child)
        assert child["restored"] is True, (mode, child)
