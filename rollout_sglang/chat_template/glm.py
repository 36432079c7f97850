"""What the GLM chat formats (GLM-4-0414 in :mod:`.glm4`, GLM-4.5 in :mod:`.glm45`) share: the role tokens and
:class:`_GlmTemplate`, whose turns end with the next message's role token instead of an end-of-turn token.
"""
from __future__ import annotations

from typing import Any, Sequence

from rollout_sglang.chat_template.base import TURN_END, Message, _TokenTemplate, _TurnEnd
from rollout_sglang.tokenizer import ENDOFTEXT, GLM_ASSISTANT, GLM_OBSERVATION, GLM_SYSTEM, GLM_USER, GMASK, SOP

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
