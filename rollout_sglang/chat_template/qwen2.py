"""The Qwen2.5 chat format (:class:`ChatTemplate`, ``qwen2``): ChatML with Hermes tool calls.

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
(``tests/rollout/test_chat_template.py`` pins this). For RL, a trajectory is built from token pieces and
never re-tokenized: :meth:`ChatTemplate.encode_prompt` (the messages + ``<|im_start|>assistant\\n``),
then the generated turn (ending with ``<|im_end|>``), then :meth:`ChatTemplate.encode_env_reply`
(``\\n`` + tool/user turns + ``<|im_start|>assistant\\n``), and so on. SFT warm-up uses
:meth:`ChatTemplate.encode_conversation`, built from exactly the same pieces.
"""
from __future__ import annotations

from typing import Any, Sequence

from rollout_sglang.chat_template.base import (
    TURN_END,
    Message,
    _call_name_args,
    _content_text,
    _tojson,
    _TokenTemplate,
    _TurnEnd,
)
from rollout_sglang.tokenizer import ENDOFTEXT, IM_END, IM_START
from rollout_sglang.tool_parser import parse_assistant_text

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


def _render_tool_call(call: dict[str, Any]) -> str:
    """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` for one OpenAI or HF-style call."""
    name, args = _call_name_args(call)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {_tojson(args)}}}\n</tool_call>'


class ChatTemplate(_TokenTemplate):
    """Qwen2.5 chat format bound to a tokenizer, with token-level incremental pieces.

    tokenizer: a Hugging Face tokenizer whose vocabulary has ``<|im_start|>`` and ``<|im_end|>`` as
        single tokens (Qwen2.5's, or one from :func:`rollout_sglang.tokenizer.train_bpe_tokenizer`).
    default_system: the system text used when the conversation starts without a system message
        (Qwen2.5's own by default; None to emit no system turn then, unless tools are given).
    """

    name = "qwen2"
    #: How errors name the format.
    FORMAT = "Qwen2.5"

    def __init__(self, tokenizer: Any, default_system: str | None = QWEN_DEFAULT_SYSTEM) -> None:
        self.tokenizer = tokenizer
        self.default_system = default_system
        vocab = tokenizer.get_vocab()
        for tok in (IM_START, IM_END):
            if tok not in vocab:
                raise ValueError(
                    f"tokenizer has no {tok!r} token; the {self.FORMAT} chat format needs <|im_start|> and "
                    f"<|im_end|> as single tokens (use a {self.FORMAT} tokenizer or "
                    "rollout_sglang.tokenizer.train_bpe_tokenizer)"
                )
        self.im_start_id: int = vocab[IM_START]
        self.im_end_id: int = vocab[IM_END]
        eos_id = tokenizer.eos_token_id
        if eos_id is None:
            eos_id = vocab.get(ENDOFTEXT)
        self.eos_token_id: int | None = eos_id
        #: What the prompt ends with, where the model's turn starts (Qwen3 without thinking: plus an empty think block)
        self.generation_prompt = f"{IM_START}assistant\n"
        self._generation_prompt_ids = self._encode(self.generation_prompt)

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
            body = self._tools_header(system)
            for tool in tools:
                body += "\n" + _tojson(tool)
            body += _TOOLS_FOOTER
            return f"{IM_START}system\n{body}{IM_END}\n"
        if system is None:
            return ""
        return f"{IM_START}system\n{system}{IM_END}\n"

    def _tools_header(self, system: str | None) -> str:
        """The system text and the ``# Tools`` header (Qwen2.5: its blank lines even without a system text)."""
        return (system if system is not None else "") + _TOOLS_HEADER

    def _render_assistant_in(self, messages: Sequence[Message], i: int, whole: bool) -> str:
        """Assistant message ``messages[i]`` as rendered among ``messages`` (``whole``: the whole conversation,
        else an env reply piece); Qwen2.5 renders it the same everywhere."""
        return self.render_assistant(messages[i])

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
                parts.append(f"{IM_START}assistant\n{self._render_assistant_in(messages, i, not lead_newline)}{IM_END}")
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
            text += self.generation_prompt
        return text

    # --------------------------------------------------------------- tokens
    def encode_prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of the conversation so far plus the ``<|im_start|>assistant\\n`` generation prompt
        (:attr:`generation_prompt`)."""
        return self._encode(self.render_text(messages, tools, add_generation_prompt=False)) + list(
            self._generation_prompt_ids
        )

    def encode_env_reply(self, messages: Sequence[Message], ended_with: int | None | _TurnEnd = TURN_END) -> list[int]:
        """Token ids that follow a finished assistant turn (which ended with ``<|im_end|>``).

        ``\\n`` + the tool/user turns of ``messages`` + ``\\n<|im_start|>assistant\\n`` (just
        ``\\n<|im_start|>assistant\\n`` when ``messages`` is empty). ended_with: the stop token that
        ended the generated turn, or None when it was cut by length: then the piece starts with
        ``<|im_end|>`` to close the turn (an env token, not a policy one).
        """
        turns = self._render_turns(list(messages), lead_newline=True)
        ids = self._encode(turns + "\n") + list(self._generation_prompt_ids)
        return [self.im_end_id] + ids if ended_with is None else ids

    def encode_assistant(self, message: Message, turn_end: int | None = None) -> list[int]:
        """Token ids of an assistant turn as the policy would generate it: its text + ``turn_end``
        (default ``<|im_end|>``)."""
        return self._encode(self.render_assistant(message)) + [self.im_end_id if turn_end is None else turn_end]

    def turn_end_id(self, following: Sequence[Message]) -> int:
        """The stop token that ends an assistant turn in a demonstration: always ``<|im_end|>``."""
        return self.im_end_id

    def parse_assistant(self, text: str, tools: Sequence[dict] | None = None, call_id_start: int = 0) -> Message:
        """A generated turn's text as an OpenAI assistant message (Hermes tool calls, see
        :func:`rollout_sglang.tool_parser.parse_assistant_text`); ToolCallParseError when malformed."""
        return parse_assistant_text(text, tools, call_id_start=call_id_start)
