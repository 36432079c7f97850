"""The GLM-4-0414 chat format (:class:`Glm4ChatTemplate`, ``glm4``): role tokens, no end-of-turn token.

The chat template of THUDM/GLM-4-9B-0414's ``tokenizer_config.json``
(``tests/rollout/test_chat_template_glm4.py`` pins it). There is no end-of-turn token: every message starts with
its role token and runs until the next one. The text is
``[gMASK]<sop>``, then with tools a ``<|system|>`` block (``\\n# 可用工具\\n``, then per tool
``\\n## {name}\\n\\n{function schema as JSON, indent 4}\\n在调用上述函数时，请使用 Json 格式表示调用的参数。``),
then every system message as ``<|system|>\\n{content}``, then the other messages:
``<|user|>\\n{content}``, ``<|assistant|>\\n{content}``, a call as ``<|assistant|>{name} \\n{arguments JSON}``
and a tool result as ``<|observation|>\\n{content}``; the generation prompt is ``<|assistant|>``.
OpenAI messages map onto it by :meth:`Glm4ChatTemplate.to_glm_messages`: an assistant message becomes
its content (when non-empty) plus one ``metadata`` message per call, a ``tool`` message an
``observation``. The model ends its turn by writing the next role token (its stop tokens are
``<|user|>``, ``<|observation|>`` and ``<|endoftext|>``, as in GLM-4's generation_config), so
the env reply piece after a generated turn leaves out the role token the model already wrote.
"""
from __future__ import annotations

import json
from typing import Sequence

from rollout_sglang.chat_template.base import Message, _call_name_args, _content_text, _tojson
from rollout_sglang.chat_template.glm import _GLM_ROLE_TOKENS, _GlmTemplate
from rollout_sglang.tokenizer import GLM_ASSISTANT, GLM_SYSTEM, GMASK, SOP
from rollout_sglang.tool_parser import parse_glm4_assistant_text

_GLM_TOOL_FOOTER = "\n在调用上述函数时，请使用 Json 格式表示调用的参数。"


class Glm4ChatTemplate(_GlmTemplate):
    """GLM-4-0414 chat format bound to a tokenizer, with token-level incremental pieces.

    tokenizer: a Hugging Face tokenizer with ``[gMASK]``, ``<sop>``, ``<|system|>``, ``<|user|>``,
        ``<|assistant|>`` and ``<|observation|>`` as single tokens (GLM-4-0414's, or one from
        :func:`rollout_sglang.tokenizer.train_bpe_tokenizer` with ``GLM4_SPECIAL_TOKENS``).

    The template has no default system message. A generated turn is what follows the
    ``<|assistant|>`` generation prompt and ends with a stop token (the next message's role
    token); in a demonstration (:meth:`encode_conversation`) that token is part of the turn.
    """

    name = "glm4"
    FORMAT = "GLM-4-0414"
    ANY_CALL_PREFIX = None  # a call starts with the tool's name: only a named call can be forced

    @staticmethod
    def to_glm_messages(messages: Sequence[Message]) -> list[Message]:
        """OpenAI-style messages as GLM-4's template takes them.

        system / user: unchanged (content as text); assistant: its content as one message when it
        is non-empty or there are no calls, then one ``{"role": "assistant", "metadata": name,
        "content": arguments JSON}`` per call; tool: ``{"role": "observation", "content": ...}``.
        Raises ValueError for another role.
        """
        out: list[Message] = []
        for i, msg in enumerate(messages):
            role = msg.get("role")
            if role in ("system", "user", "observation"):
                out.append({"role": role, "content": _content_text(msg)})
            elif role == "tool":
                out.append({"role": "observation", "content": _content_text(msg)})
            elif role == "assistant":
                calls = msg.get("tool_calls") or []
                content = _content_text(msg)
                if msg.get("metadata"):  # already in GLM form
                    out.append({"role": "assistant", "metadata": msg["metadata"], "content": content})
                    continue
                if content or not calls:
                    out.append({"role": "assistant", "content": content})
                for call in calls:
                    name, args = _call_name_args(call)
                    out.append({"role": "assistant", "metadata": name,
                                "content": args if isinstance(args, str) else _tojson(args)})
            else:
                raise ValueError(
                    f"message {i} has role {role!r}; expected one of 'system', 'user', 'assistant', 'tool'"
                )
        return out

    @staticmethod
    def _render_glm(msg: Message) -> str:
        """One GLM-form message: its role token and body (``<|assistant|>{meta} \\n`` for a call)."""
        role = msg["role"]
        if role == "assistant" and msg.get("metadata"):
            return f"{GLM_ASSISTANT}{msg['metadata']} \n{msg['content']}"
        return f"{_GLM_ROLE_TOKENS[role]}\n{msg['content']}"

    def render_system(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> str:
        """``[gMASK]<sop>``, the tools block (when tools are given) and every system message, in order."""
        text = GMASK + SOP
        if tools:
            text += f"{GLM_SYSTEM}\n# 可用工具\n"
            for tool in tools:
                fn = tool.get("function") or tool
                text += f"\n## {fn.get('name')}\n\n{json.dumps(fn, ensure_ascii=False, indent=4)}{_GLM_TOOL_FOOTER}"
        for msg in messages:
            if msg.get("role") == "system":
                text += f"{GLM_SYSTEM}\n{_content_text(msg)}"
        return text

    def render_assistant(self, message: Message) -> str:
        """An assistant message as the text the model generates after ``<|assistant|>`` (no stop token).

        ``\\n{content}`` (when non-empty, or when there are no calls), then per call
        ``{name} \\n{arguments JSON}``, the parts joined by ``<|assistant|>``.
        """
        parts = self.to_glm_messages([{**message, "role": "assistant"}])
        return GLM_ASSISTANT.join(self._render_glm(m)[len(GLM_ASSISTANT):] for m in parts)

    def render_text(
        self, messages: Sequence[Message], tools: Sequence[dict] | None = None, add_generation_prompt: bool = False
    ) -> str:
        """The whole conversation as text, identical to GLM-4-0414's jinja template output on
        :meth:`to_glm_messages` of ``messages`` (system messages all come first, as there)."""
        glm = self.to_glm_messages(messages)
        text = self.render_system(messages, tools)
        text += "".join(self._render_glm(m) for m in glm if m["role"] != "system")
        if add_generation_prompt:
            text += GLM_ASSISTANT
        return text

    def _render_in_place(self, messages: Sequence[Message]) -> str:
        return "".join(self._render_glm(m) for m in self.to_glm_messages(messages))

    def parse_assistant(self, text: str, tools: Sequence[dict] | None = None, call_id_start: int = 0) -> Message:
        """A generated turn's text as an OpenAI assistant message (GLM-4 calls, see
        :func:`rollout_sglang.tool_parser.parse_glm4_assistant_text`); ToolCallParseError when malformed."""
        return parse_glm4_assistant_text(text, tools, call_id_start=call_id_start)
