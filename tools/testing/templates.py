"""Chat templates the project's test models and benchmarks render with (no MLX, no model).

``TOOL_TEMPLATE``: Hermes/Qwen style, so mlx-lm's ``json_tools`` parser reads its tool calls;
it renders the system text, the tools (``<tools>...</tools>``), tool calls and tool responses.
Used by ``benchmarks.agent_session`` and by the ``tiny-qwen-tools`` test model
(``tools.testing.model_builds``), which must not import the benchmarks.
"""

from __future__ import annotations

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions. Their signatures, within <tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with the function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'user' or message.role == 'system' %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% elif message.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + message.content }}"
    "{% for tool_call in message.tool_calls or [] %}{% set tool_call = tool_call.function or tool_call %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + (tool_call.arguments | tojson)"
    " + '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
