# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A tiny local tokenizer shared by all tiny models (no hub access needed).

Byte-level BPE with no merges: every byte is one token, so any text encodes and
decodes losslessly with only 256 + a few ids. All tiny builders share the same
vocab size and special-token ids, so any tiny model can act as another's draft.
"""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

# Large enough for the 256 byte tokens plus specials, small enough that the
# embedding/lm_head stay a fraction of a tiny model's weights.
TINY_VOCAB_SIZE = 2048

# Ids are fixed (not left to the tokenizer) because the builders write them into
# config.json whether or not a tokenizer is written.
SPECIAL_TOKENS: dict[str, int] = {
    "<pad>": 256,
    "<bos>": 257,
    "<eos>": 258,
    "<|im_start|>": 259,
    "<|im_end|>": 260,
    # Qwen3.5 vision placeholders
    "<|vision_start|>": 261,
    "<|vision_end|>": 262,
    "<|image_pad|>": 263,
    "<|video_pad|>": 264,
    # Gemma 4 multimodal placeholders
    "<image_soft_token>": 265,
    "<start_of_image>": 266,
    "<end_of_image>": 267,
    "<video_soft_token>": 268,
    "<audio_soft_token>": 269,
    "<start_of_audio>": 270,
    "<end_of_audio>": 271,
}

PAD_ID = SPECIAL_TOKENS["<pad>"]
BOS_ID = SPECIAL_TOKENS["<bos>"]
EOS_ID = SPECIAL_TOKENS["<eos>"]

# Enough for chat-style prompts in tests; role markers are Qwen's.
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


def _byte_vocab() -> dict[str, int]:
    # alphabet() is unordered; sorting keeps ids stable between runs.
    return {sym: i for i, sym in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}


def write_tokenizer(path: str | Path) -> Path:
    """Write tokenizer.json + tokenizer_config.json into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # add_special_tokens assigns the next free ids, so add them in id order
    # and check the result rather than trust it.
    for token, _ in sorted(SPECIAL_TOKENS.items(), key=lambda kv: kv[1]):
        tok.add_special_tokens([token])
    for token, token_id in SPECIAL_TOKENS.items():
        assert tok.token_to_id(token) == token_id, token
    tok.save(str(path / "tokenizer.json"))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 1 << 20,
        "chat_template": _CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path
