"""The GLM-4.5 chat format (:class:`Glm45ChatTemplate`, ``glm45``): GLM-4's role tokens, XML tool calls, reasoning.

GLM-4.5 and GLM-4.5-Air (``model_type`` glm4_moe) use it: the chat template of zai-org/GLM-4.5
(``tests/rollout/test_chat_template_glm45.py`` pins it). The same role tokens, stop tokens and turn ends as
GLM-4-0414, but: the tools block is ``<|system|>\\n# Tools`` with one JSON line per tool
inside ``<tools></tools>`` and the instruction to answer in XML tags; messages are rendered in order
(system ones where they stand); an assistant turn is ``\\n<think>{reasoning}</think>``, then
``\\n{content}`` when there is any, then per call ``\\n<tool_call>{name}``, per argument
``\\n<arg_key>{key}</arg_key>\\n<arg_value>{value}</arg_value>`` (a string as is, any other value as
JSON), and ``\\n</tool_call>``; a run of tool messages is one ``<|observation|>`` and one
``\\n<tool_response>\\n{content}\\n</tool_response>`` per message. The reasoning (``reasoning_content``,
or a ``<think>`` block opening the content) is rendered only for assistant messages after the last user
message, as the official template does; a generated turn (and so the RL trajectory and the SFT layout, which
are never re-rendered) keeps its reasoning.
"""
from __future__ import annotations

from typing import Any, Sequence

from rollout_sglang.chat_template.base import (
    Message,
    _call_name_args,
    _content_text,
    _reasoning_and_content,
    _tojson,
)
from rollout_sglang.chat_template.glm import _GlmTemplate
from rollout_sglang.tokenizer import (
    ARG_KEY_END,
    ARG_KEY_START,
    ARG_VALUE_END,
    ARG_VALUE_START,
    GLM_ASSISTANT,
    GLM_OBSERVATION,
    GLM_SYSTEM,
    GLM_USER,
    GMASK,
    SOP,
    THINK_END,
    THINK_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
)
from rollout_sglang.tool_parser import parse_glm45_assistant_text, split_glm45_reasoning

_GLM45_TOOLS_HEADER = (
    "\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_GLM45_TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
    "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
)


class Glm45ChatTemplate(_GlmTemplate):
    """GLM-4.5 (and GLM-4.5-Air) chat format bound to a tokenizer, with token-level incremental pieces.

    tokenizer: a Hugging Face tokenizer with GLM-4's chat tokens and GLM-4.5's tags (``<think>``,
        ``<tool_call>``, ``<arg_key>``, ``<arg_value>``, ``<tool_response>`` and their closing tags) as single
        tokens (GLM-4.5's, or one from :func:`rollout_sglang.tokenizer.train_bpe_tokenizer` with
        ``GLM45_SPECIAL_TOKENS``).

    Messages take OpenAI's shape; an assistant message may carry ``reasoning_content`` (or open its content
    with ``<think>...</think>``). A generated turn is what follows ``<|assistant|>``, from its
    ``\n<think>`` to its stop token, reasoning included (:meth:`render_assistant`).

    enable_thinking: the template's switch (default on). Off, as the template writes ``enable_thinking=false``:
    every user message ends with ``/nothink`` (unless it already does) and the generation prompt is
    ``<|assistant|>\\n<think></think>``; a generated turn is then what follows that empty block (the content
    and calls; a message's reasoning is dropped there), and every prompt and env reply piece ends with it.
    """

    name = "glm45"
    FORMAT = "GLM-4.5"
    #: What the template's ``enable_thinking=false`` adds after ``<|assistant|>``, and to each user message.
    NO_THINKING = f"\n{THINK_START}{THINK_END}"
    NO_THINK_USER = "/nothink"
    EXTRA_TOKENS = (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END, ARG_KEY_START, ARG_KEY_END,
                    ARG_VALUE_START, ARG_VALUE_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)
    #: A forced call skips the reasoning (an empty think block, as GLM-4.5's no-thinking mode writes it).
    ANY_CALL_PREFIX = f"\n{THINK_START}{THINK_END}\n{TOOL_CALL_START}"

    def call_prefix(self, name: str | None) -> str | None:
        """A forced call's start: an empty think block, ``\\n<tool_call>`` and, for a named tool,
        ``{name}\\n`` (what comes before its first ``<arg_key>``, or its ``</tool_call>``)."""
        return self.ANY_CALL_PREFIX if name is None else f"{self.ANY_CALL_PREFIX}{name}\n"

    reasoning_splitter = staticmethod(split_glm45_reasoning)

    def __init__(self, tokenizer: Any, enable_thinking: bool = True) -> None:
        super().__init__(tokenizer)
        self.enable_thinking = enable_thinking
        self.generation_prompt = GLM_ASSISTANT if enable_thinking else GLM_ASSISTANT + self.NO_THINKING
        if not enable_thinking:
            self._generation_prompt_ids = self._generation_prompt_ids + self._encode(self.NO_THINKING)
            self.ANY_CALL_PREFIX = f"\n{TOOL_CALL_START}"  # the empty think block is in the prompt already

    # ----------------------------------------------------------------- text
    def render_system(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> str:
        """``[gMASK]<sop>`` and, when tools are given, the ``<|system|>`` block describing them (system
        messages are rendered in place, not here)."""
        text = GMASK + SOP
        if tools:
            text += GLM_SYSTEM + _GLM45_TOOLS_HEADER + "".join(_tojson(t) + "\n" for t in tools) + _GLM45_TOOLS_FOOTER
        return text

    @staticmethod
    def _render_call(call: dict[str, Any]) -> str:
        """``\\n<tool_call>{name}``, one ``\\n<arg_key>..</arg_key>\\n<arg_value>..</arg_value>`` per argument
        (a string as is, another value as JSON) and ``\\n</tool_call>``. ValueError when the arguments are
        not a JSON object."""
        name, args = _call_name_args(call)
        if not isinstance(args, dict):
            raise ValueError(f"tool call {name!r} has arguments {str(args)[:80]!r}; the GLM-4.5 format writes "
                             "one <arg_key>/<arg_value> pair per argument, so they must be a JSON object")
        text = f"\n{TOOL_CALL_START}{name}"
        for key, value in args.items():
            shown = value if isinstance(value, str) else _tojson(value)
            text += f"\n{ARG_KEY_START}{key}{ARG_KEY_END}\n{ARG_VALUE_START}{shown}{ARG_VALUE_END}"
        return text + f"\n{TOOL_CALL_END}"

    def _assistant_text(self, message: Message, keep_reasoning: bool) -> str:
        """An assistant message after ``<|assistant|>``; its reasoning only when ``keep_reasoning``."""
        reasoning, content = _reasoning_and_content(message)
        text = f"\n{THINK_START}{reasoning.strip() if keep_reasoning else ''}{THINK_END}"
        if content.strip():
            text += "\n" + content.strip()
        return text + "".join(self._render_call(c) for c in message.get("tool_calls") or [])

    def render_assistant(self, message: Message) -> str:
        """An assistant message as the text the model generates after ``<|assistant|>`` (no stop token):
        ``\\n<think>{reasoning}</think>``, ``\\n{content}`` when non-empty, then its calls. Without thinking the
        empty think block is in the prompt: the turn is what follows it, without the reasoning."""
        if self.enable_thinking:
            return self._assistant_text(message, keep_reasoning=True)
        return self._assistant_text(message, keep_reasoning=False)[len(self.NO_THINKING):]

    def _user_text(self, message: Message) -> str:
        """A user message's text; without thinking it ends with ``/nothink``, as the template writes it."""
        text = _content_text(message)
        if not self.enable_thinking and not text.endswith(self.NO_THINK_USER):
            text += self.NO_THINK_USER
        return text

    def _render_in_place(self, messages: Sequence[Message]) -> str:
        """``messages`` rendered where they stand; an assistant message keeps its reasoning when no user
        message follows it here (the template's rule, applied to these messages)."""
        last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
        parts: list[str] = []
        for i, msg in enumerate(messages):
            role = msg.get("role")
            if role == "tool":
                if i == 0 or messages[i - 1].get("role") != "tool":
                    parts.append(GLM_OBSERVATION)
                parts.append(f"\n{TOOL_RESPONSE_START}\n{_content_text(msg)}\n{TOOL_RESPONSE_END}")
            elif role == "assistant":
                parts.append(GLM_ASSISTANT + self._assistant_text(msg, keep_reasoning=i > last_user))
            elif role == "user":
                parts.append(f"{GLM_USER}\n{self._user_text(msg)}")
            elif role == "system":
                parts.append(f"{GLM_SYSTEM}\n{_content_text(msg)}")
            else:
                raise ValueError(
                    f"message {i} has role {role!r}; expected one of 'system', 'user', 'assistant', 'tool'"
                )
        return "".join(parts)

    def render_text(
        self, messages: Sequence[Message], tools: Sequence[dict] | None = None, add_generation_prompt: bool = False
    ) -> str:
        """The whole conversation as text, identical to GLM-4.5's jinja template output (messages in order;
        reasoning only for assistant messages after the last user message)."""
        text = self.render_system(messages, tools) + self._render_in_place(messages)
        return text + self.generation_prompt if add_generation_prompt else text

    def parse_assistant(self, text: str, tools: Sequence[dict] | None = None, call_id_start: int = 0) -> Message:
        """A generated turn's text as an OpenAI assistant message with ``reasoning_content`` (see
        :func:`rollout_sglang.tool_parser.parse_glm45_assistant_text`); ToolCallParseError when malformed."""
        return parse_glm45_assistant_text(text, tools, call_id_start=call_id_start)
