"""Tokenizers for the rollout side: load a real one, or train a tiny Qwen2.5-style one offline.

A real checkpoint brings its own ``tokenizer.json``; :func:`load_tokenizer` loads it without any
network access. Tests and the CPU demo have no checkpoint to download, so
:func:`train_bpe_tokenizer` trains a small byte-level BPE tokenizer with the same pre-tokenizer,
the same decoder and the same chat special tokens as Qwen2.5 (``<|endoftext|>``, ``<|im_start|>``,
``<|im_end|>``, ``<tool_call>``, ``</tool_call>``, and ``<tool_response>``/``</tool_response>``),
each a single id, so the chat template and tool-call parser work on it exactly as on Qwen2.5.
Given GLM-4's chat tokens instead (:data:`GLM4_SPECIAL_TOKENS`), it stands in for GLM-4-0414's
tokenizer the same way, and with :data:`GLM45_SPECIAL_TOKENS` for GLM-4.5's. Qwen3 has Qwen2.5's
special tokens and adds ``<think>`` / ``</think>`` as text tokens (:data:`QWEN3_TEXT_TOKENS`); a stand-in
without them (the default) still works with the Qwen3 format, which then reads the tags as text.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:  # transformers (and torch with it) loads when a tokenizer is made: the chat formats import without it
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

#: Control tokens (``special=True``: dropped by ``decode(..., skip_special_tokens=True)``).
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
#: Tool tags: single ids, but ordinary text when decoding (as ``<tool_call>`` is in Qwen2.5).
TOOL_TOKENS: tuple[str, ...] = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)

#: GLM-4 (0414) chat tokens: the prompt prefix and the role tokens that open every turn.
GMASK = "[gMASK]"
SOP = "<sop>"
GLM_SYSTEM = "<|system|>"
GLM_USER = "<|user|>"
GLM_ASSISTANT = "<|assistant|>"
GLM_OBSERVATION = "<|observation|>"
#: GLM-4's control tokens (special, as in its tokenizer.json); ``<|endoftext|>`` is eos as in Qwen2.5.
GLM4_SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, GMASK, SOP, GLM_SYSTEM, GLM_USER, GLM_ASSISTANT, GLM_OBSERVATION)

#: GLM-4.5's reasoning and tool-call tags (``<tool_call>`` / ``<tool_response>`` as in Qwen2.5 above).
THINK_START = "<think>"
THINK_END = "</think>"
ARG_KEY_START = "<arg_key>"
ARG_KEY_END = "</arg_key>"
ARG_VALUE_START = "<arg_value>"
ARG_VALUE_END = "</arg_value>"
#: GLM-4.5 (GLM-4.5-Air) chat tokens: GLM-4's, plus the tags its tokenizer adds as special tokens.
GLM45_SPECIAL_TOKENS: tuple[str, ...] = (
    *GLM4_SPECIAL_TOKENS, THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END, ARG_KEY_START, ARG_KEY_END,
    ARG_VALUE_START, ARG_VALUE_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END,
)
#: Qwen3's added text tokens (single ids that decode as text, as in its tokenizer.json): the reasoning tags and
#: Qwen2.5's tool tags. Its special tokens are Qwen2.5's (:data:`SPECIAL_TOKENS`).
QWEN3_TEXT_TOKENS: tuple[str, ...] = (THINK_START, THINK_END, *TOOL_TOKENS)

#: Qwen2 / Qwen2.5 pre-tokenization regex (as in its tokenizer.json).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Load a fast tokenizer from a directory (``save_pretrained`` layout) or a ``tokenizer.json`` file.

    Works offline: only local files are read. When a bare ``tokenizer.json`` is given, the
    Qwen2.5 chat tokens found in its vocabulary become ``eos``/``pad`` (``<|endoftext|>``).
    Raises FileNotFoundError naming the path and the fix when nothing loadable is there.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
            raise FileNotFoundError(
                f"no tokenizer in directory {str(p)!r} (expected tokenizer.json and tokenizer_config.json); "
                "point the tokenizer path at a Hugging Face checkpoint directory, or build one with "
                "rollout_sglang.tokenizer.train_bpe_tokenizer(texts, vocab_size, out_dir)"
            )
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    if p.is_file():
        if p.suffix != ".json":
            raise FileNotFoundError(
                f"{str(p)!r} is not a tokenizer.json file nor a directory; pass the checkpoint directory "
                "or its tokenizer.json"
            )
        tok = PreTrainedTokenizerFast(tokenizer_file=str(p))
        vocab = tok.get_vocab()
        if ENDOFTEXT in vocab:
            tok.eos_token = ENDOFTEXT
            tok.pad_token = ENDOFTEXT
        return tok
    raise FileNotFoundError(
        f"tokenizer path {str(p)!r} does not exist; set it to a Hugging Face checkpoint directory "
        "(containing tokenizer.json) or to a tokenizer.json file, or build a small one offline with "
        "rollout_sglang.tokenizer.train_bpe_tokenizer(texts, vocab_size, out_dir)"
    )


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | os.PathLike,
    min_frequency: int = 2,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    text_tokens: Sequence[str] = TOOL_TOKENS,
) -> PreTrainedTokenizerFast:
    """Train a Qwen2.5-style byte-level BPE tokenizer on ``texts`` and save it to ``out_dir``.

    vocab_size: the total size, BPE vocabulary (256 bytes + merges) plus the added chat tokens
        (7 by default); with little text fewer merges are learned, so use ``len(tokenizer)`` as
        the real size.
    min_frequency: a pair must occur this often to be merged.
    special_tokens: control tokens added as single special ids (Qwen2.5's by default;
        :data:`GLM4_SPECIAL_TOKENS` for a GLM-4 stand-in, :data:`GLM45_SPECIAL_TOKENS` for GLM-4.5);
        must include ``<|endoftext|>``.
    text_tokens: tokens added as single ids that decode as ordinary text (Qwen2.5's tool tags by
        default; :data:`QWEN3_TEXT_TOKENS` for a Qwen3 stand-in; ``()`` for GLM-4 and GLM-4.5).
    Offline and deterministic (same texts, same result). The special tokens come after the BPE
    vocabulary, as in Qwen2.5; ``<|endoftext|>`` is both eos and pad. Writes ``tokenizer.json``
    and ``tokenizer_config.json`` (loadable by ``AutoTokenizer.from_pretrained(out_dir)``) and
    returns the loaded tokenizer.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special_tokens, text_tokens = tuple(special_tokens), tuple(text_tokens)
    if ENDOFTEXT not in special_tokens:
        raise ValueError(f"special_tokens={special_tokens} must include {ENDOFTEXT!r} (the eos and pad token)")
    n_added = len(special_tokens) + len(text_tokens)
    min_size = 256 + n_added
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs 256 byte tokens plus "
            f"{n_added} chat tokens; use vocab_size >= {min_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    # The chat tokens must not be learned as merges of their characters: strip them from the corpus.
    def _clean(it: Iterable[str]) -> Iterable[str]:
        for t in it:
            for s in special_tokens + text_tokens:
                t = t.replace(s, " ")
            yield t

    tok.train_from_iterator(_clean(texts), trainer=trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special_tokens])
    if text_tokens:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in text_tokens])

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    fast.save_pretrained(str(out))
    logger.info("trained byte-level BPE tokenizer: %d tokens, saved to %s", len(fast), out)
    return load_tokenizer(out)
