"""Chat formats as text and as incremental token pieces: Qwen2.5 / Hermes, Qwen3, GLM-4-0414 and GLM-4.5.

The classes share one interface (the agent loop, the SFT warm-up and the trainer use only it):
``stop_token_ids``, ``render_text``, ``render_assistant``, ``encode_prompt``, ``encode_env_reply``,
``encode_assistant``, ``encode_conversation``, ``parse_assistant`` and ``decode``.
:func:`build_chat_template` builds one by name (:data:`CHAT_TEMPLATES`: qwen2 | glm4 | glm45 | qwen3);
``model.chat_template`` also takes auto, the default format of the model's family, which the trainer resolves
(``megatron_agentrl.convert.resolve_chat_template``).

One module per format: :mod:`.qwen2` (:class:`ChatTemplate`: ChatML, Qwen2.5, Hermes tool calls), :mod:`.qwen3`
(:class:`Qwen3ChatTemplate`), :mod:`.glm4` (:class:`Glm4ChatTemplate`, GLM-4-0414) and :mod:`.glm45`
(:class:`Glm45ChatTemplate`); :mod:`.base` holds the token-piece machinery they all share and :mod:`.glm` what the
two GLM formats share. A new format is a module here and its line in ``_TEMPLATE_CLASSES``.
"""
from __future__ import annotations

from typing import Any

from rollout_sglang.chat_template.base import TURN_END, Message
from rollout_sglang.chat_template.glm4 import Glm4ChatTemplate
from rollout_sglang.chat_template.glm45 import Glm45ChatTemplate
from rollout_sglang.chat_template.qwen2 import QWEN_DEFAULT_SYSTEM, ChatTemplate
from rollout_sglang.chat_template.qwen3 import Qwen3ChatTemplate

__all__ = ["CHAT_TEMPLATES", "QWEN_DEFAULT_SYSTEM", "THINKING_TEMPLATES", "TURN_END", "AnyChatTemplate",
           "ChatTemplate", "Glm4ChatTemplate", "Glm45ChatTemplate", "Message", "Qwen3ChatTemplate",
           "build_chat_template", "thinking_switch_problem"]

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
