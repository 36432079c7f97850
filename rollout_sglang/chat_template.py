"""Qwen2.5 / Hermes chat format, as text and as incremental token pieces.

The layout is ChatML, ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, with Qwen2.5's
function-calling conventions:

* tools are described in the system message: the system text, then a ``# Tools`` section listing
  one JSON object per tool inside ``<tools></tools>`` and the instruction to answer with
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``;
* an assistant turn is its content followed by one ``\\n<tool_call>\\n{json}\\n</tool_call>`` per
  call (no leading newline when the content is empty);
* tool results come back as a ``user`` turn holding one ``\\n<tool_response>\\n...\\n</tool_response>``
  block per tool message; consecutive tool messages share one turn.

:meth:`ChatTemplate.render_text` produces the same text as Qwen2.5's official jinja template
(``tests/test_chat_template.py`` pins this). For RL, a trajectory is built from token pieces and
never re-tokenized: :meth:`ChatTemplate.encode_prompt` (the messages + ``<|im_start|>assistant\\n``),
then the generated turn (ending with ``<|im_end|>``), then :meth:`ChatTemplate.encode_env_reply`
(``\\n`` + tool/user turns + ``<|im_start|>assistant\\n``), and so on. SFT warm-up uses
:meth:`ChatTemplate.encode_conversation`, built from exactly the same pieces.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from rollout_sglang.tokenizer import ENDOFTEXT, IM_END, IM_START

logger = logging.getLogger(__name__)

#: The system message Qwen2.5 inserts when the conversation has none.
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

_TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)

Message = dict[str, Any]


def _tojson(obj: Any) -> str:
    """JSON as the Hugging Face chat-template ``tojson`` filter writes it (``json.dumps``, non-ASCII kept)."""
    return json.dumps(obj, ensure_ascii=False)


def _content_text(message: Message) -> str:
    """A message's content as text (None -> ""; a list of ``{"type": "text"}`` parts is joined)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _render_tool_call(call: dict[str, Any]) -> str:
    """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` for one OpenAI or HF-style call."""
    fn = call.get("function", call)
    name = fn.get("name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        # OpenAI messages carry arguments as a JSON string; Qwen's template dumps the object.
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            logger.warning("tool call %r has arguments that are not JSON; rendering them as a string", name)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {_tojson(args)}}}\n</tool_call>'


class ChatTemplate:
    """Qwen2.5 chat format bound to a tokenizer, with token-level incremental pieces.

    tokenizer: a Hugging Face tokenizer whose vocabulary has ``<|im_start|>`` and ``<|im_end|>`` as
        single tokens (Qwen2.5's, or one from :func:`rollout_sglang.tokenizer.train_bpe_tokenizer`).
    default_system: the system text used when the conversation starts without a system message
        (Qwen2.5's own by default; None to emit no system turn then, unless tools are given).
    """

    def __init__(self, tokenizer: Any, default_system: str | None = QWEN_DEFAULT_SYSTEM) -> None:
        self.tokenizer = tokenizer
        self.default_system = default_system
        vocab = tokenizer.get_vocab()
        for tok in (IM_START, IM_END):
            if tok not in vocab:
                raise ValueError(
                    f"tokenizer has no {tok!r} token; the Qwen2.5 chat format needs <|im_start|> and <|im_end|> "
                    "as single tokens (use a Qwen2.5 tokenizer or rollout_sglang.tokenizer.train_bpe_tokenizer)"
                )
        self.im_start_id: int = vocab[IM_START]
        self.im_end_id: int = vocab[IM_END]
        eos_id = tokenizer.eos_token_id
        if eos_id is None:
            eos_id = vocab.get(ENDOFTEXT)
        self.eos_token_id: int | None = eos_id
        self._generation_prompt_ids = self._encode(f"{IM_START}assistant\n")
        self._turn_end_ids = [self.im_end_id]

    # ----------------------------------------------------------------- text
    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that end an assistant turn: ``<|im_end|>`` and the tokenizer's eos (deduplicated)."""
        ids = [self.im_end_id]
        if self.eos_token_id is not None and self.eos_token_id != self.im_end_id:
            ids.append(self.eos_token_id)
        return ids

    def render_system(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> str:
        """The system turn (with ``<|im_end|>\\n``), or "" when there is none; tools are described in it."""
        first_is_system = bool(messages) and messages[0].get("role") == "system"
        system = _content_text(messages[0]) if first_is_system else self.default_system
        if tools:
            body = (system if system is not None else "") + _TOOLS_HEADER
            for tool in tools:
                body += "\n" + _tojson(tool)
            body += _TOOLS_FOOTER
            return f"{IM_START}system\n{body}{IM_END}\n"
        if system is None:
            return ""
        return f"{IM_START}system\n{system}{IM_END}\n"

    def render_assistant(self, message: Message) -> str:
        """An assistant message as the text the model generates after ``<|im_start|>assistant\\n``.

        Content, then one ``<tool_call>`` block per call, each preceded by a newline unless it is
        the very first thing in the turn. No ``<|im_end|>``.
        """
        text = _content_text(message)
        for call in message.get("tool_calls") or []:
            block = _render_tool_call(call)
            text = f"{text}\n{block}" if text else block
        return text

    def _render_turns(self, messages: Sequence[Message], lead_newline: bool) -> str:
        """Render non-system-leading messages as ChatML turns, each ending with ``<|im_end|>``.

        Turns are separated by ``\\n``; ``lead_newline`` also puts one before the first turn (the
        ``\\n`` that follows a generated ``<|im_end|>``). Tool messages merge into one user turn.
        """
        parts: list[str] = []
        n = len(messages)
        i = 0
        while i < n:
            msg = messages[i]
            role = msg.get("role")
            if role == "tool":
                blocks = []
                while i < n and messages[i].get("role") == "tool":
                    blocks.append(f"\n<tool_response>\n{_content_text(messages[i])}\n</tool_response>")
                    i += 1
                parts.append(f"{IM_START}user{''.join(blocks)}{IM_END}")
                continue
            if role == "assistant":
                parts.append(f"{IM_START}assistant\n{self.render_assistant(msg)}{IM_END}")
            elif role in ("user", "system"):
                parts.append(f"{IM_START}{role}\n{_content_text(msg)}{IM_END}")
            else:
                raise ValueError(
                    f"message {i} has role {role!r}; expected one of 'system', 'user', 'assistant', 'tool'"
                )
            i += 1
        text = "\n".join(parts)
        if lead_newline and parts:
            text = "\n" + text
        return text

    def render_text(
        self, messages: Sequence[Message], tools: Sequence[dict] | None = None, add_generation_prompt: bool = False
    ) -> str:
        """The whole conversation as text, identical to Qwen2.5's jinja template output.

        messages: OpenAI-style messages (assistant ``tool_calls`` with ``function.arguments`` as a JSON
            string or an object); tools: OpenAI function schemas. With ``add_generation_prompt`` the
            text ends with ``<|im_start|>assistant\\n``.
        """
        body = list(messages[1:]) if messages and messages[0].get("role") == "system" else list(messages)
        text = self.render_system(messages, tools)
        turns = self._render_turns(body, lead_newline=False)
        if turns:
            text += turns + "\n"
        if add_generation_prompt:
            text += f"{IM_START}assistant\n"
        return text

    # --------------------------------------------------------------- tokens
    def _encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (chat tokens parsed as single ids, no BOS/EOS added)."""
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of the conversation so far plus the ``<|im_start|>assistant\\n`` generation prompt."""
        return self._encode(self.render_text(messages, tools, add_generation_prompt=False)) + list(
            self._generation_prompt_ids
        )

    def encode_env_reply(self, messages: Sequence[Message]) -> list[int]:
        """Token ids that follow a finished assistant turn (which ended with ``<|im_end|>``).

        ``\\n`` + the tool/user turns of ``messages`` + ``\\n<|im_start|>assistant\\n`` (just
        ``\\n<|im_start|>assistant\\n`` when ``messages`` is empty).
        """
        turns = self._render_turns(list(messages), lead_newline=True)
        return self._encode(turns + "\n") + list(self._generation_prompt_ids)

    def encode_assistant(self, message: Message) -> list[int]:
        """Token ids of an assistant turn as the policy would generate it: its text + ``<|im_end|>``."""
        return self._encode(self.render_assistant(message)) + list(self._turn_end_ids)

    def encode_conversation(
        self, messages: Sequence[Message], tools: Sequence[dict] | None = None
    ) -> tuple[list[int], list[int]]:
        """A whole demonstration as ``(token_ids, loss_mask)``, laid out exactly like an RL trajectory.

        Prompt (every message before the first assistant message) + generation prompt, mask 0;
        each assistant turn (text + ``<|im_end|>``), mask 1; between two assistant turns, the env
        reply piece (:meth:`encode_env_reply`), mask 0. Messages after the last assistant message
        are dropped. Raises ValueError when there is no assistant message.
        """
        first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
        if first is None:
            raise ValueError("encode_conversation needs at least one assistant message to train on")
        ids = self.encode_prompt(messages[:first], tools)
        mask = [0] * len(ids)
        i = first
        while True:
            turn = self.encode_assistant(messages[i])
            ids += turn
            mask += [1] * len(turn)
            nxt = next((j for j in range(i + 1, len(messages)) if messages[j].get("role") == "assistant"), None)
            if nxt is None:
                break
            reply = self.encode_env_reply(messages[i + 1 : nxt])
            ids += reply
            mask += [0] * len(reply)
            i = nxt
        return ids, mask

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with chat tokens kept (for parsing generated turns and for tests)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
