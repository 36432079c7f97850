"""Chat formats as text and as incremental token pieces: Qwen2.5 / Hermes, Qwen3, GLM-4-0414 and GLM-4.5.

The classes share one interface (the agent loop, the SFT warm-up and the trainer use only it):
``stop_token_ids``, ``render_text``, ``render_assistant``, ``encode_prompt``, ``encode_env_reply``,
``encode_assistant``, ``encode_conversation``, ``parse_assistant`` and ``decode``.
:func:`build_chat_template` builds one by name (:data:`CHAT_TEMPLATES`: qwen2 | glm4 | glm45 | qwen3);
``model.chat_template`` also takes auto, the default format of the model's family, which the trainer resolves
(``megatron_agentrl.convert.resolve_chat_template``).

**Qwen2.5** (:class:`ChatTemplate`). The layout is ChatML, ``<|im_start|>{role}\\n{content}<|im_end|>\\n``
per message, with Qwen2.5's function-calling conventions:

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

**Qwen3** (:class:`Qwen3ChatTemplate`, Qwen3 and Qwen3-MoE, ``model_type`` qwen3 / qwen3_moe), the chat template
of Qwen/Qwen3-8B's ``tokenizer_config.json`` (``tests/rollout/test_chat_template_qwen3.py`` pins it): Qwen2.5's layout
and stop tokens without its default system message, and with reasoning: a generated turn opens with
``<think>\\n{reasoning}\\n</think>\\n\\n``, returned as ``reasoning_content``. As for GLM-4.5, the template
shows the reasoning only after the last user query, while a trajectory and the SFT layout keep every turn as
generated (see the class for where they differ from a re-render).

**GLM-4-0414** (:class:`Glm4ChatTemplate`), the chat template of THUDM/GLM-4-9B-0414's
``tokenizer_config.json`` (``tests/rollout/test_chat_template_glm4.py`` pins it). There is no end-of-turn
token: every message starts with its role token and runs until the next one. The text is
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

**GLM-4.5** (:class:`Glm45ChatTemplate`, GLM-4.5 and GLM-4.5-Air, ``model_type`` glm4_moe), the chat template
of zai-org/GLM-4.5 (``tests/rollout/test_chat_template_glm45.py`` pins it). The same role tokens, stop tokens and
turn ends as GLM-4-0414, but: the tools block is ``<|system|>\\n# Tools`` with one JSON line per tool
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

import json
import logging
from typing import Any, Callable, Sequence

from rollout_sglang.tokenizer import (
    ARG_KEY_END,
    ARG_KEY_START,
    ARG_VALUE_END,
    ARG_VALUE_START,
    ENDOFTEXT,
    GLM_ASSISTANT,
    GLM_OBSERVATION,
    GLM_SYSTEM,
    GLM_USER,
    GMASK,
    IM_END,
    IM_START,
    SOP,
    THINK_END,
    THINK_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
)
from rollout_sglang.tool_parser import (
    ToolCallParseError,
    parse_assistant_text,
    parse_glm4_assistant_text,
    parse_glm45_assistant_text,
    parse_qwen3_assistant_text,
    split_glm45_reasoning,
    split_qwen3_reasoning,
)

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
#: Arguments whose rendering marks where a call's arguments start (see ``call_prefix``).
_SENTINEL_ARGS = {"__agentrl_arguments__": 0}

class _TurnEnd:
    """Type of :data:`TURN_END`."""

    def __repr__(self) -> str:
        return "TURN_END"


#: ``encode_env_reply(..., ended_with=TURN_END)``: the generated turn ended the way the format
#: expects (Qwen2.5: ``<|im_end|>``; GLM-4: the role token of the reply's first message).
TURN_END = _TurnEnd()


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


def _call_name_args(call: dict[str, Any]) -> tuple[Any, Any]:
    """(name, arguments) of one OpenAI or HF-style call; JSON-string arguments are parsed to an object
    (kept as the string, with a warning, when they are not JSON)."""
    fn = call.get("function", call)
    name = fn.get("name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        # OpenAI messages carry arguments as a JSON string; the templates dump the object.
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            logger.warning("tool call %r has arguments that are not JSON; rendering them as a string", name)
    return name, args


def _reasoning_and_content(message: Message) -> tuple[str, str]:
    """(reasoning, content) of an assistant message as GLM-4.5's and Qwen3's templates read them (the same jinja):
    ``reasoning_content`` when it is a string, else the text before ``</think>`` in the content (after its
    ``<think>``), the content then being the text after it."""
    content = _content_text(message)
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        return reasoning, content
    if THINK_END in content:  # the template's own split, kept character for character
        head, tail = content.split(THINK_END)[0], content.split(THINK_END)[-1]
        return head.rstrip("\n").split(THINK_START)[-1].lstrip("\n"), tail.lstrip("\n")
    return "", content


def _render_tool_call(call: dict[str, Any]) -> str:
    """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` for one OpenAI or HF-style call."""
    name, args = _call_name_args(call)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {_tojson(args)}}}\n</tool_call>'


class _TokenTemplate:
    """What both chat formats share: plain encoding, decoding, and the demonstration layout.

    Subclasses provide ``encode_prompt``, ``encode_assistant(message, turn_end)``,
    ``turn_end_id(following)``, ``encode_env_reply(messages, ended_with)`` and ``render_assistant``.
    """

    tokenizer: Any
    #: What a turn forced to call some tool (``tool_choice: required``) starts with; None when the format's
    #: calls start with the tool's name (GLM-4), so only a named call can be forced.
    ANY_CALL_PREFIX: str | None = TOOL_CALL_START + "\n"

    def call_prefix(self, name: str | None) -> str | None:
        """The text that starts a call to tool ``name`` up to its arguments, as the format writes it (forced
        by ``tool_choice``), or :data:`ANY_CALL_PREFIX` for ``name`` None."""
        if name is None:
            return self.ANY_CALL_PREFIX
        text = self.render_assistant({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": _SENTINEL_ARGS}}]})
        return text[: text.index(_tojson(_SENTINEL_ARGS))]

    #: the format's reader of the ``<think>`` block opening a turn (raises ToolCallParseError when it is not
    #: closed); None for formats without reasoning
    reasoning_splitter: Callable[[str], tuple[str, str]] | None = None

    def split_reasoning(self, text: str) -> tuple[str, str]:
        """``(reasoning, rest)`` of a generated turn's text: the ``<think>`` block opening it, stripped, and what
        follows; ("", text) for formats without reasoning, and when the block is missing or not closed."""
        if self.reasoning_splitter is None:
            return "", text
        try:
            return self.reasoning_splitter(text)
        except ToolCallParseError:
            return "", text

    def _encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (chat tokens parsed as single ids, no BOS/EOS added)."""
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_conversation(
        self, messages: Sequence[Message], tools: Sequence[dict] | None = None
    ) -> tuple[list[int], list[int]]:
        """A whole demonstration as ``(token_ids, loss_mask)``, laid out exactly like an RL trajectory.

        Prompt (every message before the first assistant message) + generation prompt, mask 0;
        each assistant turn (text + the stop token :meth:`turn_end_id` picks), mask 1; between two
        assistant turns, the env reply piece (:meth:`encode_env_reply` after that stop token),
        mask 0. Messages after the last assistant message are dropped. Raises ValueError when
        there is no assistant message.
        """
        first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
        if first is None:
            raise ValueError("encode_conversation needs at least one assistant message to train on")
        ids = self.encode_prompt(messages[:first], tools)
        mask = [0] * len(ids)
        i = first
        while True:
            nxt = next((j for j in range(i + 1, len(messages)) if messages[j].get("role") == "assistant"), None)
            between = messages[i + 1 : nxt] if nxt is not None else []
            turn = self.encode_assistant(messages[i], self.turn_end_id(between))
            ids += turn
            mask += [1] * len(turn)
            if nxt is None:
                break
            reply = self.encode_env_reply(between, ended_with=turn[-1])
            ids += reply
            mask += [0] * len(reply)
            i = nxt
        return ids, mask

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with chat tokens kept (for parsing generated turns and for tests)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


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



# ------------------------------------------------------------------------------------------ Qwen3
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



# ------------------------------------------------------------------------------------ GLM-4-0414
_GLM_TOOL_FOOTER = "\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
_GLM_ROLE_TOKENS = {"system": GLM_SYSTEM, "user": GLM_USER, "assistant": GLM_ASSISTANT, "observation": GLM_OBSERVATION}


class _GlmTemplate(_TokenTemplate):
    """What GLM-4-0414 and GLM-4.5 share: the ``[gMASK]<sop>`` prefix, the role tokens, no end-of-turn
    token (a turn ends with the stop token that is the next message's role token), the generation
    prompt ``<|assistant|>`` and the env reply piece that leaves out the role token the model wrote.

    Subclasses provide ``render_text``, ``render_assistant``, ``parse_assistant`` and
    ``_render_in_place(messages)`` (messages rendered where they stand, for env reply pieces).
    """

    name: str
    #: How errors name the format, and the tokens it needs as single ids beyond [gMASK], <sop> and the roles.
    FORMAT = "GLM"
    EXTRA_TOKENS: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        needed = (GMASK, SOP, *_GLM_ROLE_TOKENS.values(), *self.EXTRA_TOKENS)
        missing = [t for t in needed if t not in vocab]
        if missing:
            raise ValueError(
                f"tokenizer has no {', '.join(missing)} token(s); the {self.FORMAT} chat format needs "
                f"{', '.join(needed)} as single tokens (use {self.FORMAT}'s tokenizer, or set model.chat_template "
                "to the format of this tokenizer, e.g. qwen2)"
            )
        self.role_ids: dict[str, int] = {role: vocab[tok] for role, tok in _GLM_ROLE_TOKENS.items()}
        eos_id = tokenizer.eos_token_id
        if eos_id is None:
            eos_id = vocab.get(ENDOFTEXT)
        self.eos_token_id: int | None = eos_id
        self._generation_prompt_ids = [self.role_ids["assistant"]]

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that end an assistant turn: ``<|user|>``, ``<|observation|>`` and eos (deduplicated)."""
        ids = [self.role_ids["user"], self.role_ids["observation"]]
        if self.eos_token_id is not None and self.eos_token_id not in ids:
            ids.append(self.eos_token_id)
        return ids

    def _render_in_place(self, messages: Sequence[Message]) -> str:
        raise NotImplementedError

    def encode_prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of the conversation so far plus the ``<|assistant|>`` generation prompt."""
        return self._encode(self.render_text(messages, tools)) + list(self._generation_prompt_ids)

    def encode_env_reply(self, messages: Sequence[Message], ended_with: int | None | _TurnEnd = TURN_END) -> list[int]:
        """Token ids that follow a finished assistant turn: ``messages`` rendered in place, then ``<|assistant|>``.

        ended_with: the stop token that ended the generated turn (None: cut by length). When it is
        the role token the piece starts with (the model announced the reply, e.g. ``<|observation|>``
        before tool results), that token is left out, as it is already in the trajectory;
        ``TURN_END`` assumes so. A system message here is rendered where it stands (GLM-4-0414's full
        template would move it to the front).
        """
        ids = self._encode(self._render_in_place(messages)) + list(self._generation_prompt_ids)
        drop = ids[0] if isinstance(ended_with, _TurnEnd) else ended_with
        if drop is not None and ids[0] == drop and drop != self.role_ids["assistant"]:
            ids = ids[1:]
        return ids

    def turn_end_id(self, following: Sequence[Message]) -> int:
        """The stop token that ends an assistant turn followed by ``following`` in a demonstration:
        ``<|observation|>`` before a tool result, else ``<|user|>`` (also at the very end)."""
        if following and following[0].get("role") in ("tool", "observation"):
            return self.role_ids["observation"]
        return self.role_ids["user"]

    def encode_assistant(self, message: Message, turn_end: int | None = None) -> list[int]:
        """Token ids of an assistant turn as the policy would generate it: its text + the stop token
        ``turn_end`` (default ``<|observation|>`` when it calls tools, else ``<|user|>``)."""
        if turn_end is None:
            turn_end = self.role_ids["observation"] if message.get("tool_calls") else self.role_ids["user"]
        return self._encode(self.render_assistant(message)) + [turn_end]


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



# ---------------------------------------------------------------------------------------- GLM-4.5
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


# ------------------------------------------------------------------------------------- selection
AnyChatTemplate = ChatTemplate | Qwen3ChatTemplate | Glm4ChatTemplate | Glm45ChatTemplate
_TEMPLATE_CLASSES: dict[str, type[AnyChatTemplate]] = {
    "qwen2": ChatTemplate, "glm4": Glm4ChatTemplate, "glm45": Glm45ChatTemplate, "qwen3": Qwen3ChatTemplate}
#: Chat formats :func:`build_chat_template` knows, by name. ``model.chat_template`` also accepts "auto", which
#: the trainer resolves to the default format of the model's family (``megatron_agentrl.convert``) before it
#: builds one.
CHAT_TEMPLATES: tuple[str, ...] = tuple(_TEMPLATE_CLASSES)
#: The formats whose official template has the ``enable_thinking`` switch (on by default in both).
THINKING_TEMPLATES: tuple[str, ...] = ("qwen3", "glm45")


def thinking_switch_problem(name: str, enable_thinking: bool | None) -> str | None:
    """Why format ``name`` cannot take ``enable_thinking`` (None: it can; None, the format's default, always can)."""
    if enable_thinking is None or name in THINKING_TEMPLATES or name not in _TEMPLATE_CLASSES:
        return None
    return (f"the {_TEMPLATE_CLASSES[name].FORMAT} chat format ({name}) has no thinking switch; enable_thinking "
            f"applies to {' and '.join(THINKING_TEMPLATES)} (leave it null for the format's default)")


def build_chat_template(name: str, tokenizer: Any, enable_thinking: bool | None = None) -> AnyChatTemplate:
    """The chat format ``name`` (one of :data:`CHAT_TEMPLATES`) bound to ``tokenizer``.

    enable_thinking: the official template's ``enable_thinking`` switch, for the formats that have one
        (:data:`THINKING_TEMPLATES`); None: the format's default (on).
    Raises ValueError naming an unknown ``name`` (and "auto", which the caller resolves from the model's family),
    and for an ``enable_thinking`` given to a format without the switch.
    """
    cls = _TEMPLATE_CLASSES.get(name)
    if cls is None:
        why = " ('auto' is resolved from the model's family before a format is built)" if name == "auto" else ""
        raise ValueError(f"chat template {name!r} is not one of {', '.join(CHAT_TEMPLATES)}{why}")
    problem = thinking_switch_problem(name, enable_thinking)
    if problem:
        raise ValueError(problem)
    if enable_thinking is None:
        return cls(tokenizer)
    return cls(tokenizer, enable_thinking=enable_thinking)  # type: ignore[call-arg]
