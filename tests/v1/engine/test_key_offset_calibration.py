# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine calibrates TurboQuant key offsets with one prefill at start.

CPU: the prompt (seeded, the model's BOS first), its length (bounded by the
model length and an unchunked batch), the engine's side (the prompt served
through its own loop, the offsets set before the prefix cache forgets its
blocks), and the workers' side (sums opened, the mean set in place, layers
that stored nothing reported).
GPU: a tiny Qwen3 engine with 3-bit keys comes up with every 3-bit layer's
offset equal to the mean post-RoPE key of the calibration prompt as
transformers computes it (fp32, on the CPU), and no prefix-cache block left
from the calibration prompt.
That engines calibrate alike is what the GPU gate's ``tqm`` lane checks: its
3-bit MTP cells equal the same preset without speculation, token for token.
"""

import re
from types import SimpleNamespace

import pytest
import torch

from vllm.model_executor.layers.quantization.turboquant import key_offset
from vllm.v1.engine import key_offset_calibration as calibration


def test_the_prompt_is_seeded_and_starts_with_bos():
    a = calibration.calibration_prompt(1000, 300, bos=7)
    assert a == calibration.calibration_prompt(1000, 300, bos=7)
    assert len(a) == 300 and a[0] == 7 and max(a) < 1000 and len(set(a)) > 200
    assert calibration.calibration_prompt(1000, 300, bos=None)[1:] == a[1:]


def _core(max_model_len=32768, chunked=True, batched=8192):
    return SimpleNamespace(
        vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=max_model_len),
            scheduler_config=SimpleNamespace(
                enable_chunked_prefill=chunked, max_num_batched_tokens=batched
            ),
        )
    )


@pytest.mark.parametrize(
    "core, length",
    [
        (_core(), key_offset.CALIBRATION_TOKENS),
        (_core(max_model_len=512), 511),
        (_core(max_model_len=1024), 1023),
        (_core(chunked=False, batched=1024), 1024),
    ],
)
def test_the_length_fits_the_engine(core, length):
    """The model length and an unchunked batch bound it; the KV cache's size
    does not (an engine with a drafter has a smaller share for the main
    model's layers, and must calibrate on the same prompt)."""
    assert calibration.calibration_length(core) == length


def _worker(layers):
    context = dict(layers)
    return SimpleNamespace(
        vllm_config=SimpleNamespace(
            compilation_config=SimpleNamespace(static_forward_context=context)
        )
    )


def _layer(hk=2, d=4, offset=True):
    layer = torch.nn.Module()
    if offset:
        layer._tq_key_offset = torch.zeros(hk, d)
    return layer


def test_workers_set_the_mean_of_the_keys_stored():
    seen, unseen, other = _layer(), _layer(), _layer(offset=False)
    worker = _worker({"a": seen, "b": unseen, "c": other})
    assert key_offset.start_calibration(worker, 3) == 2
    keys = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)
    key_offset.observe_keys(seen, keys[:2])
    key_offset.observe_keys(seen, keys[2:])
    # Past the prompt's length (a step scheduled ahead): not summed.
    key_offset.observe_keys(seen, keys + 100)
    key_offset.observe_keys(other, keys)  # no offset: nothing to sum
    assert key_offset.finish_calibration(worker) == ["b"]
    torch.testing.assert_close(seen._tq_key_offset, keys.mean(0))
    assert not unseen._tq_key_offset.any()
    # Closed: later stores are not summed.
    key_offset.observe_keys(seen, keys * 0)
    assert not hasattr(seen, "_tq_key_sums")


def test_an_engine_without_offset_layers_serves_no_calibration():
    calls = []
    core = _core()
    core.model_executor = SimpleNamespace(
        collective_rpc=lambda fn, args=(): calls.append(fn.__name__) or [0]
    )
    core.add_request = lambda *a: calls.append("add_request")
    calibration.calibrate_key_offsets(core)
    assert calls == ["start_calibration"]


def _serving_core():
    """A core whose executor and scheduler log what calibration asks of them;
    each request finishes in one step."""
    log, queue = [], []
    core = _core(max_model_len=4096, batched=512)
    core.vllm_config.parallel_config = SimpleNamespace(data_parallel_size=1)
    core.vllm_config.model_config.get_vocab_size = lambda: 1000
    core.vllm_config.model_config.hf_text_config = SimpleNamespace(bos_token_id=1)

    def rpc(fn, args=()):
        log.append((fn.__name__, *args))
        return [1] if fn is key_offset.start_calibration else [[]]

    core.model_executor = SimpleNamespace(collective_rpc=rpc)
    core.preprocess_add_request = lambda request: (request, 0)
    core.add_request = lambda request, wave: queue.append(request.prompt_token_ids)
    core.scheduler = SimpleNamespace(has_requests=lambda: bool(queue))
    core.step_fn = lambda: (log.append(("step", queue.pop())), True)
    core.post_step = lambda executed: None
    core.reset_prefix_cache = lambda: log.append(("reset",))
    return core, log


def test_the_engine_serves_the_prompt_then_sets_offsets_then_forgets_it():
    """The workers set the offsets from the keys the prompt stored, and only
    then does the prefix cache forget the prompt's blocks (stored before any
    offset existed), so no later request can hit them."""
    core, log = _serving_core()
    calibration.calibrate_key_offsets(core)
    n = key_offset.CALIBRATION_TOKENS
    prompt = calibration.calibration_prompt(1000, n, bos=1)
    assert log == [
        ("start_calibration", n),
        ("step", prompt),
        ("finish_calibration",),
        ("reset",),
    ]


def _mean_keys(model, prompt: list[int]) -> list[torch.Tensor]:
    """Each layer's mean cached (post-RoPE) key over ``prompt``, [Hk, D]."""
    with torch.no_grad():
        cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
    return [layer.keys[0].mean(1) for layer in cache.layers]


def _offsets(worker):
    context = worker.vllm_config.compilation_config.static_forward_context
    return {
        name: layer._tq_key_offset.cpu()
        for name, layer in context.items()
        if getattr(layer, "_tq_key_offset", None) is not None
    }


@pytest.mark.gpu
def test_an_engine_starts_with_calibrated_offsets(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from tests.models.tiny_hybrids import checkpoints as ck
    from vllm import LLM, SamplingParams

    # Writing the checkpoint left threads behind (tqdm's monitor); an engine
    # process forked from here can deadlock on a lock one of them held.
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # collective_rpc sends _offsets (a function) to the engine process.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    path = ck.build_checkpoint("qwen3_dense", tmp_path / "qwen3_dense")
    llm = LLM(
        model=str(path),
        skip_tokenizer_init=True,
        max_model_len=1024,
        kv_cache_memory_bytes=256 * 2**20,
        gpu_memory_utilization=0.1,
        enforce_eager=True,
        kv_cache_dtype="turboquant_3bit_nc",
        dtype=ck.MATRIX_DTYPE,
        enable_prefix_caching=True,
        seed=0,
        **ck.MODELS["qwen3_dense"].engine_kwargs,
    )
    (offsets,) = llm.collective_rpc(_offsets)
    assert offsets, "no layer took a key offset"
    model_config = llm.llm_engine.model_config
    bos = getattr(model_config.hf_text_config, "bos_token_id", None)
    # max_model_len - 1 tokens (calibration_length).
    means = _mean_keys(
        ck.load_for_cpu(path),
        calibration.calibration_prompt(model_config.get_vocab_size(), 1023, bos),
    )
    for name, offset in offsets.items():
        ref = means[int(re.search(r"layers\.(\d+)\.", name).group(1))]
        # fp16 keys against fp32 ones; the mean of the pre-RoPE keys is off
        # by more than the whole offset here.
        err = (offset - ref).abs().max() / ref.abs().max()
        assert err < 0.05, f"{name}: offset off the prompt's mean key by {err:.1%}"
    prompt = calibration.calibration_prompt(
        model_config.get_vocab_size(),
        256,
        getattr(model_config.hf_text_config, "bos_token_id", None),
    )
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0)
    )
    assert not out[0].num_cached_tokens, "the calibration prompt's blocks stayed"
