"""The Qwen3 chat format (:class:`Qwen3ChatTemplate`, ``qwen3``): Qwen2.5's layout with ``<think>`` reasoning.

Qwen3 and Qwen3-MoE (``model_type`` qwen3 / qwen3_moe) use it: the chat template of Qwen/Qwen3-8B's
``tokenizer_config.json`` (``tests/rollout/test_chat_template_qwen3.py`` pins it): Qwen2.5's layout and stop tokens
without its default system message, and with reasoning: a generated turn opens with
``<think>\\n{reasoning}\\n</think>\\n\\n``, returned as ``reasoning_content``. As for GLM-4.5, the template
shows the reasoning only after the last user query, while a trajectory and the SFT layout keep every turn as
generated (see the class for where they differ from a re-render).
"""
from __future__ import annotations

from typing import Any, Sequence

from rollout_sglang.chat_template.base import Message, _reasoning_and_content, _tojson
from rollout_sglang.chat_template.qwen2 import _TOOLS_HEADER, ChatTemplate
from rollout_sglang.tokenizer import (
    THINK_END,
    THINK_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
)
from rollout_sglang.tool_parser import parse_qwen3_assistant_text, split_qwen3_reasoning


def _is_qwen3_query(message: Message) -> bool:
    """Whether Qwen3's template counts ``message`` as a user query: a user message with text content that is not
    only tool results (``<tool_response>...</tool_response>``, as agents that send results as user turns write
    them). Content given as parts is no query there (the template tests ``content is string``)."""
    content = message.get("content")
    if message.get("role") != "user" or not isinstance(content, str):
        return False
    return not (content.startswith(TOOL_RESPONSE_START) and content.endswith(TOOL_RESPONSE_END))


def _render_qwen3_call(call: dict[str, Any]) -> str:
    """One Hermes call as Qwen3's template writes it: arguments given as a string are written as they are (no
    re-serialization, unlike Qwen2.5's ``tojson``), an object as JSON."""
    fn = call.get("function") or call
    args = fn.get("arguments", {})
    shown = args if isinstance(args, str) else _tojson(args)
    return f'{TOOL_CALL_START}\n{{"name": "{fn.get("name")}", "arguments": {shown}}}\n{TOOL_CALL_END}'


class Qwen3ChatTemplate(ChatTemplate):
    """Qwen3 (and Qwen3-MoE) chat format bound to a tokenizer: Qwen2.5's ChatML turns, Hermes tool calls, tool
    results and stop tokens, with Qwen3's differences (the chat template of Qwen/Qwen3-8B's
    ``tokenizer_config.json``, pinned by ``tests/rollout/test_chat_template_qwen3.py``):

    * no default system message; with tools and no system message the system turn starts with ``# Tools``;
    * an assistant turn may open with its reasoning, ``<think>\\n{reasoning}\\n</think>\\n\\n`` (from
      ``reasoning_content``, or a ``<think>`` block in the content), which :meth:`parse_assistant` and
      :meth:`split_reasoning` return as ``reasoning_content``;
    * call arguments given as a string are written as they are.

    The template shows the think block only for assistant messages after the last user query (a user message
    that is not only ``<tool_response>`` blocks), and there only when the reasoning is non-empty or the message
    is the last one; earlier turns show their content alone. A generated turn (:meth:`render_assistant`, and so
    a trajectory and :meth:`encode_conversation`, which are never re-rendered) always opens with its think block,
    an empty one when it has no reasoning, as Qwen3 writes it. The pieces therefore equal the template's render
    of the whole conversation when every assistant turn comes after the last user query and each one before the
    last has reasoning; elsewhere the trajectory keeps what a re-render drops.

    tokenizer: as :class:`ChatTemplate`; ``<think>`` and ``</think>`` may be single tokens (Qwen3's own,
        :data:`rollout_sglang.tokenizer.QWEN3_TEXT_TOKENS`) or plain text.
    enable_thinking: the template's switch (default on). Off, the generation prompt ends with an empty think block,
        ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n``, as the template writes it for
        ``enable_thinking=false``; a generated turn (:meth:`render_assistant`) is then the content and calls alone
        (a message's reasoning is dropped there), and every prompt and env reply piece ends with that block, so the
        engine's prompt and the trainer's encoding stay one text.
    """

    name = "qwen3"
    FORMAT = "Qwen3"
    #: A forced call skips the reasoning: an empty think block, as Qwen3's no-thinking mode writes it.
    ANY_CALL_PREFIX = f"{THINK_START}\n\n{THINK_END}\n\n{TOOL_CALL_START}\n"
    #: What the template's ``enable_thinking=false`` adds after the generation prompt.
    NO_THINKING = f"{THINK_START}\n\n{THINK_END}\n\n"

    def __init__(self, tokenizer: Any, enable_thinking: bool = True) -> None:
        super().__init__(tokenizer, default_system=None)
        self.enable_thinking = enable_thinking
        if not enable_thinking:
            self.generation_prompt += self.NO_THINKING
            self._generation_prompt_ids = self._encode(self.generation_prompt)
            self.ANY_CALL_PREFIX = TOOL_CALL_START + "\n"  # the empty think block is in the prompt already

    def _tools_header(self, system: str | None) -> str:
        """The system text and the ``# Tools`` header; without a system text the header starts the turn."""
        return _TOOLS_HEADER.lstrip("\n") if system is None else system + _TOOLS_HEADER

    reasoning_splitter = staticmethod(split_qwen3_reasoning)

    def _assistant_text(self, message: Message, show_think: bool) -> str:
        """An assistant message after ``<|im_start|>assistant\\n``, with its think block when ``show_think``
        (the template's layout, character for character)."""
        reasoning, content = _reasoning_and_content(message)
        text = content
        if show_think:
            text = f"{THINK_START}\n" + reasoning.strip("\n") + f"\n{THINK_END}\n\n" + content.lstrip("\n")
        for k, call in enumerate(message.get("tool_calls") or []):
            # the template tests the content as read (before the lstrip above) for the first call's newline
            text += ("\n" if k or content else "") + _render_qwen3_call(call)
        return text

    def render_assistant(self, message: Message) -> str:
        """An assistant message as the text the model generates after the generation prompt (no ``<|im_end|>``):
        ``<think>\\n{reasoning}\\n</think>\\n\\n`` (empty when it has none), the content, then one ``<tool_call>``
        block per call, each after a newline unless it starts the content. Without thinking the think block is in
        the prompt: the turn is what follows it, without the reasoning."""
        if self.enable_thinking:
            return self._assistant_text(message, show_think=True)
        _, content = _reasoning_and_content(message)
        text = self._assistant_text({**message, "reasoning_content": "", "content": content}, show_think=True)
        return text[len(self.NO_THINKING):]

    def _render_assistant_in(self, messages: Sequence[Message], i: int, whole: bool) -> str:
        """``messages[i]`` with its think block where the template shows one: after the last user query, when it
        has reasoning or (``whole``) is the last message. Without a query the template shows none in a whole
        conversation; an env reply piece comes after the episode's first query, so there it counts from -1."""
        queries = [j for j, m in enumerate(messages) if _is_qwen3_query(m)]
        last_query = queries[-1] if queries else (len(messages) - 1 if whole else -1)
        reasoning, _ = _reasoning_and_content(messages[i])
        show = i > last_query and (bool(reasoning) or (whole and i == len(messages) - 1))
        return self._assistant_text(messages[i], show)

    def parse_assistant(self, text: str, tools: Sequence[dict] | None = None, call_id_start: int = 0) -> Message:
        """A generated turn's text as an OpenAI assistant message with ``reasoning_content`` (Hermes calls after
        the think block, see :func:`rollout_sglang.tool_parser.parse_qwen3_assistant_text`);
        ToolCallParseError when malformed."""
        return parse_qwen3_assistant_text(text, tools, call_id_start=call_id_start)
