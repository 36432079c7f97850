"""The chat formats of the chat-template and gateway tests, one per format: each model's jinja chat template written
out to pin it (rendered with jinja2 as Hugging Face renders it), the messages in the shape that template takes, a
small tokenizer with the format's chat tokens trained on its renders, the conversations that exercise its
reasoning, and a scripted engine that plays the calc episode (see ``support.FakeEnv``) in the format."""
from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_sglang.chat_template import (
    QWEN_DEFAULT_SYSTEM,
    Glm4ChatTemplate,
    Glm45ChatTemplate,
    Qwen3ChatTemplate,
)
from rollout_sglang.tokenizer import GLM4_SPECIAL_TOKENS, GLM45_SPECIAL_TOKENS, QWEN3_TEXT_TOKENS, train_bpe_tokenizer
from tests.rollout.support import (
    CONVERSATION,
    REASONING_CONVERSATION,
    TRIP_TOOLS,
    ScriptEngine,
    render_jinja,
    tool_call,
)

# the tools of the conversations (GLM-4, GLM-4.5, Qwen3); Qwen2.5's differ in one description
TOOLS = [
    {"type": "function", "function": {
        "name": "search", "description": "Search the web (données, 搜索).",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}},
    {"type": "function", "function": {"name": "submit", "description": "Submit the answer.",
                                      "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}}}},
]

QWEN25_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web (données).",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    },
    {
        "type": "function",
        "function": {"name": "submit", "description": "Submit the answer.",
                     "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}}},
    },
]
USERLESS = [m for m in REASONING_CONVERSATION if m["role"] != "user"]  # no user turn
LATE_SYSTEM = CONVERSATION[1:3] + [{"role": "system", "content": "Be brief."}] + CONVERSATION[3:5]


def render_cases(tools: list[dict], late_system: bool = False) -> list[tuple[list[dict], list[dict] | None]]:
    """The conversations every format's text is pinned on, as (messages, tools): system + tools (several calls in a
    turn, consecutive tool messages, a late user turn), no system message, a system message without tools, neither,
    tool calls without a tool list, and with ``late_system`` a system message that is not the first."""
    cases = [(CONVERSATION, tools), (CONVERSATION[1:], tools), (CONVERSATION[:2], None), (CONVERSATION[1:2], None),
             (CONVERSATION[1:7], None)]
    return cases + [(LATE_SYSTEM, tools)] if late_system else cases


def check_jinja_render(template: Any, render: Callable[..., str], shape: Callable[[list[dict]], list[dict]],
                       messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> None:
    """``template`` renders the messages as ``render`` (the format's jinja template) does, and renders them the same
    when given in the shape that jinja template takes (``shape``)."""
    expected = render(messages, tools, add_generation_prompt)
    assert template.render_text(messages, tools, add_generation_prompt) == expected
    assert template.render_text(shape(messages), tools, add_generation_prompt) == expected


# ------------------------------------------------------------------------------------------------ Qwen2.5
# Qwen2.5-Instruct's chat template (function-calling version), written out here to pin the format.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- '" + QWEN_DEFAULT_SYSTEM + "' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\n" + QWEN_DEFAULT_SYSTEM + "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def qwen25_messages(messages: list[dict]) -> list[dict]:
    """Messages as HF templates expect them: tool-call arguments as objects, content None -> ""."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("content") is None:
            m["content"] = ""
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


def render_qwen25(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
    """Render QWEN25_TEMPLATE with jinja2 configured as Hugging Face does."""
    return render_jinja(QWEN25_TEMPLATE, qwen25_messages(messages), tools, add_generation_prompt)


def qwen25_tokenizer(out_dir: Path):
    """A small Qwen2.5-style BPE tokenizer trained on the rendered conversations."""
    texts = [render_qwen25(CONVERSATION, QWEN25_TOOLS, False), render_qwen25(CONVERSATION[1:], None, True)] * 5
    return train_bpe_tokenizer(texts, vocab_size=600, out_dir=out_dir)


# ------------------------------------------------------------------------------------------------ GLM-4-0414
# The "chat_template" of THUDM/GLM-4-9B-0414's tokenizer_config.json
# (https://huggingface.co/THUDM/GLM-4-9B-0414/blob/main/tokenizer_config.json), written out here
# to pin the format: tools as a "# 可用工具" system block, a call as an assistant message whose
# ``metadata`` is the function name and whose content is the arguments JSON, tool results as
# ``observation`` messages, generation prompt "<|assistant|>".
GLM4_0414_TEMPLATE = (
    "[gMASK]<sop>{%- if tools -%}<|system|>\n# 可用工具\n{% for tool in tools %}"
    "{%- set function = tool.function if tool.get(\"function\") else tool %}\n\n## {{ function.name }}\n\n"
    "{{ function | tojson(indent=4, ensure_ascii=False) }}\n在调用上述函数时，请使用 Json 格式表示调用的参数。"
    "{%- endfor %}{%- endif -%}"
    "{%- for msg in messages %}{%- if msg.role == 'system' %}<|system|>\n{{ msg.content }}{%- endif %}{%- endfor %}"
    "{%- for message in messages if message.role != 'system' %}{%- set role = message['role'] %}"
    "{%- set content = message['content'] %}{%- set meta = message.get(\"metadata\", \"\") %}"
    "{%- if role == 'user' %}<|user|>\n{{ content }}"
    "{%- elif role == 'assistant' and not meta %}<|assistant|>\n{{ content }}"
    "{%- elif role == 'assistant' and meta %}<|assistant|>{{ meta }} \n{{ content }}"
    "{%- elif role == 'observation' %}<|observation|>\n{{ content }}"
    "{%- endif %}{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def glm4_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages in the shape GLM-4's template renders: each call its own assistant message
    (``metadata`` = name, content = arguments JSON), after the content when there is some; tool
    results as ``observation``; content None -> ""."""
    out = []
    for m in copy.deepcopy(messages):
        content = m.get("content") or ""
        if m["role"] == "tool":
            out.append({"role": "observation", "content": content})
        elif m["role"] == "assistant":
            calls = m.get("tool_calls") or []
            if content or not calls:
                out.append({"role": "assistant", "content": content})
            for c in calls:
                args = json.loads(c["function"]["arguments"])
                out.append({"role": "assistant", "metadata": c["function"]["name"],
                            "content": json.dumps(args, ensure_ascii=False)})
        else:
            out.append({"role": m["role"], "content": content})
    return out


def render_glm4(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
    """Render GLM4_0414_TEMPLATE with jinja2 configured as Hugging Face does."""
    return render_jinja(GLM4_0414_TEMPLATE, glm4_messages(messages), tools, add_generation_prompt)


def glm4_tokenizer(out_dir: Path):
    """A small byte-level BPE tokenizer with GLM-4's chat tokens, trained on the rendered conversations."""
    texts = [render_glm4(CONVERSATION, TOOLS, False), render_glm4(CONVERSATION[1:], None, True)] * 5
    return train_bpe_tokenizer(texts, vocab_size=700, out_dir=out_dir, special_tokens=GLM4_SPECIAL_TOKENS,
                               text_tokens=())


GLM4_SCRIPT = ['\nLet me add.<|assistant|>add \n{"a": 40, "b": 2}<|observation|>',
               'add\n{"a": 1, "b": 1}<|assistant|>add\n{"a": 2, "b": 2}<|observation|>',
               "\nThe answer is 42.<|user|>"]


def glm4_engine(template: Glm4ChatTemplate) -> ScriptEngine:
    """Plays GLM4_SCRIPT, the calc episode in GLM-4's format."""
    return ScriptEngine(template, GLM4_SCRIPT, "<|assistant|>")


# ------------------------------------------------------------------------------------------------ GLM-4.5
# The chat template of zai-org/GLM-4.5 (https://huggingface.co/zai-org/GLM-4.5/blob/main/chat_template.jinja),
# written out here to pin the format. Rendered with trim_blocks and lstrip_blocks, as Hugging Face does.
# Its enable_thinking lines (a user turn ends with "/nothink", the generation prompt with "\n<think></think>")
# were checked against the template GLM-4.5-Air's GGUF carries, as a llama.cpp server prints it.
GLM45_TEMPLATE = r"""[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>{%- endif -%}
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {% set ns.last_user_index = loop.index0 -%}
    {%- endif %}
{%- endfor %}
{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{{ m.content }}
{{- '/nothink' if (enable_thinking is defined and not enable_thinking
    and not m.content.endswith("/nothink")) else '' -}}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = '' %}
{%- set content = m.content %}
{%- if m.reasoning_content is string %}
    {%- set reasoning_content = m.reasoning_content %}
{%- else %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
{%- endif %}
{%- if loop.index0 > ns.last_user_index and reasoning_content -%}
{{ '\n<think>' + reasoning_content.strip() +  '</think>'}}
{%- else -%}
{{ '\n<think></think>' }}
{%- endif -%}
{%- if content.strip() -%}
{{ '\n' + content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '\n<tool_response>\n' }}
{{- m.content }}
{{- '\n</tool_response>' }}
{%- elif m.role == 'system' -%}
<|system|>
{{ m.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>{{- '\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}
{%- endif -%}
"""

# CONVERSATION with reasoning on the turns after its last user message (the ones a trajectory keeps as rendered)
GLM45_THINKING = copy.deepcopy(CONVERSATION)
GLM45_THINKING[8]["reasoning_content"] = "The user wants it submitted."
GLM45_THINKING[10]["content"] = "<think>Submitted; now answer.</think>\n" + GLM45_THINKING[10]["content"]


def glm45_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as GLM-4.5's template takes them: content None -> "", call arguments as objects."""
    out = []
    for m in copy.deepcopy(messages):
        m["content"] = m.get("content") or ""
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
        out.append(m)
    return out


def render_glm45(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool, **kwargs: Any) -> str:
    """Render GLM45_TEMPLATE with jinja2 configured as Hugging Face does (``kwargs``: e.g. enable_thinking)."""
    return render_jinja(GLM45_TEMPLATE, glm45_messages(messages), tools, add_generation_prompt, **kwargs)


def glm45_tokenizer(out_dir: Path):
    """A small byte-level BPE tokenizer with GLM-4.5's chat tokens, trained on the rendered conversations."""
    texts = [render_glm45(CONVERSATION, TOOLS, False), render_glm45(REASONING_CONVERSATION, TRIP_TOOLS, True),
             render_glm45(CONVERSATION[1:], None, True)] * 5
    return train_bpe_tokenizer(texts, vocab_size=900, out_dir=out_dir, special_tokens=GLM45_SPECIAL_TOKENS,
                               text_tokens=())


def glm45_call(name: str, *pairs: tuple[str, str]) -> str:
    """A GLM-4.5 tool call of ``name`` with the ``(key, value)`` argument pairs, as the model writes it."""
    return f"<tool_call>{name}" + "".join(f"\n<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>" for k, v in pairs) + \
        "\n</tool_call>"


GLM45_SCRIPT = [
    "\n<think>Add them.</think>\nLet me add.\n" + glm45_call("add", ("a", "40"), ("b", "2")) + "<|observation|>",
    "\n<think></think>\n" + glm45_call("add", ("a", "1"), ("b", "1")) + "\n" + glm45_call("add", ("a", "2"), ("b", "2"))
    + "<|observation|>",
    "\n<think>Both sums are in.</think>\nThe answer is 42.<|user|>"]


def glm45_engine(template: Glm45ChatTemplate, script: list[str] = GLM45_SCRIPT) -> ScriptEngine:
    """Plays ``script`` (the calc episode in GLM-4.5's format by default)."""
    return ScriptEngine(template, script, "<|assistant|>")


# ------------------------------------------------------------------------------------------------ Qwen3
# The "chat_template" of Qwen/Qwen3-8B's tokenizer_config.json
# (https://huggingface.co/Qwen/Qwen3-8B/blob/main/tokenizer_config.json), written out here to pin the format.
# Rendered with trim_blocks and lstrip_blocks, as Hugging Face does. Its longest lines are split over adjacent
# Python string literals (nothing is added between them): the text is the source's, character for character.
QWEN3_TEMPLATE = (
    r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"""
    r"""You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\n"""
    r"""For each function call, return a json object with function name and arguments """
    r"""within <tool_call></tool_call> XML tags:\n"""
    r"""<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and """
    r"""not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n')"""
    r""".split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + """
    r"""reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
)

# CONVERSATION with reasoning on the turns after its last user message (a field, and a block opening the content)
QWEN3_THINKING = copy.deepcopy(CONVERSATION)
QWEN3_THINKING[8]["reasoning_content"] = "\nThe user wants it submitted.\n"
QWEN3_THINKING[10]["content"] = "<think>\nSubmitted; now answer.\n</think>\n\n" + QWEN3_THINKING[10]["content"]
# one query, then every turn reasoning (as Qwen3 writes it): the template keeps every think block
AGENTIC = [m for i, m in enumerate(copy.deepcopy(CONVERSATION)) if i not in (7, 8, 9)]
AGENTIC[2]["reasoning_content"] = "Search first (検索)."
AGENTIC[4]["content"] = "<think>\nTwo more searches.\n</think>\n\n"
AGENTIC[7]["reasoning_content"] = "Enough."
# results sent back as a user turn of <tool_response> blocks: no query, so the reasoning after it still shows
MULTI_STEP = AGENTIC[:4] + [{"role": "user", "content": "<tool_response>\nmore\n</tool_response>"}] + AGENTIC[4:]
# a turn after the last query without reasoning (no block shown), and a last one without (an empty block shown)
BARE = [CONVERSATION[1], {"role": "assistant", "content": "Let me look.",
                          "tool_calls": [tool_call("call_0", "search", {"q": "x"})]},
        {"role": "tool", "content": "y"}, {"role": "assistant", "content": "It is y."}]


def qwen3_messages(messages: list[dict]) -> list[dict]:
    """The messages with tool-call arguments as objects (Hugging Face style) instead of JSON strings."""
    out = copy.deepcopy(messages)
    for m in out:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


def render_qwen3(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool, **kwargs: Any) -> str:
    """Render QWEN3_TEMPLATE with jinja2 configured as Hugging Face does (it takes OpenAI messages as they are;
    ``kwargs``: e.g. enable_thinking)."""
    return render_jinja(QWEN3_TEMPLATE, copy.deepcopy(messages), tools, add_generation_prompt, **kwargs)


def train_qwen3_tokenizer(texts: list[str], out_dir, text_tokens=QWEN3_TEXT_TOKENS):
    """A Qwen3-style tokenizer trained on ``texts`` (<think> and </think> added text tokens unless ``text_tokens``)."""
    return train_bpe_tokenizer(texts * 5, vocab_size=900, out_dir=out_dir, text_tokens=text_tokens)


def qwen3_tokenizer(out_dir: Path):
    """A small byte-level BPE tokenizer with Qwen3's chat tokens (<think> and </think> as added text tokens)."""
    texts = [render_qwen3(CONVERSATION, TOOLS, False), render_qwen3(REASONING_CONVERSATION, TRIP_TOOLS, True),
             render_qwen3(AGENTIC, TOOLS, False)]
    return train_qwen3_tokenizer(texts, out_dir)


def qwen3_call(a: int, b: int) -> str:
    return '<tool_call>\n{"name": "add", "arguments": {"a": %d, "b": %d}}\n</tool_call>' % (a, b)


QWEN3_SCRIPT = ["<think>\nAdd them.\n</think>\n\nLet me add.\n" + qwen3_call(40, 2),
                "<think>\nCheck twice.\n</think>\n\n" + qwen3_call(1, 1) + "\n" + qwen3_call(2, 2),
                "<think>\nBoth sums are in.\n</think>\n\nThe answer is 42."]


def qwen3_engine(template: Qwen3ChatTemplate, script: list[str] = QWEN3_SCRIPT) -> ScriptEngine:
    """Plays ``script`` (the calc episode in Qwen3's format by default)."""
    return ScriptEngine(template, script, "<|im_start|>assistant\n", template.im_end_id)


def qwen3_messages_as_given(messages: list[dict]) -> list[dict]:
    """The messages as Qwen3's template takes them: OpenAI messages as they are (a copy)."""
    return copy.deepcopy(messages)
