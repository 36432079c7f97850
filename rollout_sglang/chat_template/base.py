"""What every chat format shares: token-piece encoding, the demonstration layout and the message helpers.

:class:`_TokenTemplate` is the base of each format's class (one module per format in this package); it encodes
text to token ids with chat tokens as single ids, decodes them, and lays a demonstration out exactly like an RL
trajectory from the format's own pieces. :data:`TURN_END` tells ``encode_env_reply`` that the generated turn
ended the way the format expects. The helpers read OpenAI and HF-style messages and calls the way the formats'
jinja templates read them.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, Sequence

from rollout_sglang.tokenizer import THINK_END, THINK_START, TOOL_CALL_START
from rollout_sglang.tool_parser import ToolCallParseError

logger = logging.getLogger(__name__)

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


class _TokenTemplate:
    """What the chat formats share: plain encoding, decoding, and the demonstration layout.

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
