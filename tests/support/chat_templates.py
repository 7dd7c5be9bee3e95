"""Chat templates of five families, short and faithful to what each does with roles:
Qwen2.5 (tools in the system turn, system messages anywhere), Llama 3 (header per
message), Gemma (system text folded into the first user turn, roles must alternate:
``raise_exception`` otherwise), SmolLM2 (its own, read from the build) and the tool-rendering
ChatML of ``benchmarks.agent_session``."""

from __future__ import annotations

import json

QWEN25 = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are Qwen.{% endif %}"
    "\n\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- else %}<|im_start|>system\nYou are Qwen.<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
LLAMA3 = (
    "<|begin_of_text|>"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{%- for message in messages %}<|start_header_id|>{{ 'ipython' if message.role == 'tool' else message.role }}"
    "<|end_header_id|>\n\n{{ message.content | trim }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
GEMMA = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' %}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ (first_user_prefix if loop.first else '') + message['content'] | trim }}<end_of_turn>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<start_of_turn>model\n{%- endif %}"
)


def smollm2() -> str:
    """SmolLM2-135M-Instruct's own template (from the smollm2 build)."""
    from tools.testing.model_builds import model_path

    return str(json.loads((model_path("smollm2") / "tokenizer_config.json").read_text())["chat_template"])


def families() -> dict[str, str]:
    from benchmarks.agent_session import TOOL_TEMPLATE

    return {"qwen2.5": QWEN25, "llama3": LLAMA3, "gemma": GEMMA, "smollm2": smollm2(), "tools-chatml": TOOL_TEMPLATE}
