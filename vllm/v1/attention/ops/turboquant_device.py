# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the TurboQuant decode kernels ask of the device they run on."""

import functools

import torch

from vllm.platforms import current_platform

# By device type and index: a CPU tensor's device has no index, like the
# current CUDA device's.
_sm_counts: dict[tuple[str, int], int] = {}


def num_sms(device: torch.device) -> int:
    """``device``'s SM count (the split policy's unit of parallelism)."""
    key = (device.type, device.index or 0)
    if key not in _sm_counts:
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(key[1])
            _sm_counts[key] = props.multi_processor_count
        else:
            # CPU tensors: any fixed figure will do.
            _sm_counts[key] = 4
    return _sm_counts[key]


def use_fp8_e4b15(device: torch.device) -> int:
    """Whether FP8 keys convert as e4b15 on ``device``: 0.20.2's rule (Ampere
    and Ada have no e4m3 conversions), which its store kernels follow too.
    Other devices take e4m3."""
    if device.type != "cuda":
        return 0
    # Imported at the call: 0.20.2's decode module imports the decode entry
    # point, which imports this module.
    from vllm.v1.attention.ops.triton_turboquant_decode import _use_fp8_e4b15

    return _use_fp8_e4b15(device.index or 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def nvidia_capability(device: torch.device) -> tuple[int, int]:
    """``device``'s compute capability if it is an NVIDIA GPU, else (0, 0).

    ROCm reports its GPUs as ``"cuda"`` devices with a capability too
    (gfx90a 9.0, gfx942 9.4), and 0.20.2 lists TurboQuant among ROCm's
    backends; but the Gluon stage 1 (PTX inline assembly, mma_v2) and
    programmatic launches (``griddepcontrol``) exist on NVIDIA GPUs only."""
    if device.type != "cuda" or not current_platform.is_cuda():
        return (0, 0)
    return _capability(device.index or 0)


def programmatic_launch(device: torch.device) -> bool:
    """Whether the Gluon stage 1 and the merge launch programmatically on
    ``device`` (PDL, sm_90+): each is placed on the SMs as the kernel before
    it drains, and waits for it (``griddepcontrol.wait``) before it touches
    memory, instead of ~1.4 us of launch gap between each two kernels of a
    decode (3-7 % of Qwen3-4B 1 x 32K, 1-2 % of 16 x 8K on an H100;
    benchmarks/NOTES.md).

    The query rotation lets stage 1 start only as it ends: letting it start
    at once (``launch_dependents`` on entry) made 512 rows of 640 tokens 2-3 %
    slower on the MSE presets."""
    return nvidia_capability(device) >= (9, 0)
