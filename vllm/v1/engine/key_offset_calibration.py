# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine's start-up prefill that calibrates TurboQuant key offsets.

Layers with 3- or 4-bit TurboQuant MSE keys store them shifted by their mean key
(``turboquant.key_offset``). The mean is the model's own: once the engine is
built, and before it takes a request, it serves one request of seeded random
token ids through its scheduler and workers, as any request is served (chunked
prefill, hybrids' state, a drafter), while those layers sum the keys they
store. The workers then set the offsets, and the prefix cache forgets the
request's blocks, which were stored before the offsets existed.
"""

import time
from typing import TYPE_CHECKING

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.turboquant.key_offset import (
    CALIBRATION_SEED,
    CALIBRATION_TOKENS,
    finish_calibration,
    start_calibration,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest

if TYPE_CHECKING:
    from vllm.v1.engine.core import EngineCore

logger = init_logger(__name__)

REQUEST_ID = "turboquant-key-offset-calibration"
# The fewest tokens worth calibrating on; an engine whose model length is
# shorter keeps zero offsets (its keys stored as without an offset) and says
# so.
MIN_TOKENS = 64


def calibration_length(core: "EngineCore") -> int:
    """Tokens of the calibration prompt: ``CALIBRATION_TOKENS``, or fewer
    where the model length or an unchunked batch cannot hold them.

    It depends on the model and these limits only, not on the KV cache's
    size: an engine with a drafter (whose layers take a share of the cache)
    calibrates on the same prompt as one without, so both store the same
    bytes. The engine holds a ``max_model_len`` request by construction.
    """
    config = core.vllm_config
    n = min(CALIBRATION_TOKENS, config.model_config.max_model_len - 1)
    scheduler_config = config.scheduler_config
    if not scheduler_config.enable_chunked_prefill:
        n = min(n, scheduler_config.max_num_batched_tokens)
    return n


def calibration_prompt(vocab_size: int, length: int, bos: int | None) -> list[int]:
    """Seeded uniform token ids below ``vocab_size``, after ``bos`` where the
    model has one (as a tokenizer would start a text)."""
    g = torch.Generator().manual_seed(CALIBRATION_SEED)
    ids = torch.randint(0, vocab_size, (length,), generator=g).tolist()
    if bos is not None and 0 <= bos < vocab_size:
        ids[0] = bos
    return ids


def calibrate_key_offsets(core: "EngineCore") -> None:
    """Fill the key offsets of every worker's TurboQuant layers that take
    one (a no-op for an engine without any); run once the engine is built."""
    executor = core.model_executor
    length = calibration_length(core)
    if not any(executor.collective_rpc(start_calibration, args=(length,))):
        return
    config = core.vllm_config
    if length < MIN_TOKENS or config.parallel_config.data_parallel_size > 1:
        executor.collective_rpc(finish_calibration)
        logger.warning(
            "TurboQuant: key offsets not calibrated (%s); MSE keys are stored "
            "without one, as 0.20.2 stores them.",
            "data parallel engines would step apart"
            if length >= MIN_TOKENS
            else f"max_model_len leaves fewer than {MIN_TOKENS} calibration tokens",
        )
        return
    start = time.perf_counter()
    model_config = config.model_config
    prompt = calibration_prompt(
        model_config.get_vocab_size(),
        length,
        getattr(model_config.hf_text_config, "bos_token_id", None),
    )
    request = EngineCoreRequest(
        request_id=REQUEST_ID,
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    core.add_request(*core.preprocess_add_request(request))
    # Chunks of at least one token each, and a margin for the drafter's and
    # the output's steps.
    for _ in range(length + 16):
        if not core.scheduler.has_requests():
            break
        _, executed = core.step_fn()
        core.post_step(executed)
    else:
        core.abort_requests([REQUEST_ID])
        raise RuntimeError(
            f"TurboQuant key offset calibration: the {length}-token calibration "
            f"prefill did not finish in {length + 16} engine steps. The engine's "
            "KV cache or batch limits may not hold it: raise "
            "--gpu-memory-utilization or --max-num-batched-tokens, or serve "
            "turboquant_k8v4, whose FP8 keys take no offset"
        )
    unseen = executor.collective_rpc(finish_calibration)
    core.reset_prefix_cache()
    missing = sorted({name for names in unseen for name in names})
    if missing:
        logger.warning(
            "TurboQuant: %d layers stored no calibration key (%s); their keys "
            "are stored without an offset.",
            len(missing),
            ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else ""),
        )
    logger.info(
        "TurboQuant: key offsets calibrated on %d random tokens in %.2f s.",
        length,
        time.perf_counter() - start,
    )
