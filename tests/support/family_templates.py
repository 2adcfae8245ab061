"""Test chat templates that render tool calls, tool results and the generation prompt the way each tool-call family's
REAL chat template does, for the agent test model (kvshuttle.workers.agent_script): tests/e2e/agents/test_forced_calls.py
starts one gateway per family with one of these (``--chat-template``) on the same workers, forces a call, echoes it
back and checks that the next turn pulls.

Everything else is the agent model's own template: the system prompt and the tool list first, every message framed as
``<|im_start|>ROLE\\n...<|im_end|>\\n`` (the agent tokenizer's special tokens: ``<|im_end|>`` is its EOS, so it stands
for each family's end of an assistant message, ``<|eot_id|>``, ``</s>``, ``<｜end▁of▁sentence｜>``), the generation
prompt ``<|im_start|>assistant\\n``. What each family's own template does, read from the real one:

- ``hermes``: the agent model's own template (Hermes 2 Pro / Qwen2.5's ``<tool_call>\\n{"name": ..., "arguments":
  ...}\\n</tool_call>``, results as ``<tool_response>`` in a user turn): agent_script.chat_template("echo").
- ``qwen3_json``: Qwen3's (the same calls, Qwen3's reasoning rule): agent_script.chat_template("qwen3").
- ``qwen3_coder``: Qwen3-Coder's (vLLM's examples/tool_chat_template_qwen3coder.jinja, as its tokenizer_config.json):
  ``<|im_start|>assistant`` then, per call, ``\\n<tool_call>\\n<function=NAME>\\n`` and per argument
  ``<parameter=KEY>\\nVALUE\\n</parameter>\\n`` (a string as is, ``| string`` for scalars, ``tojson`` for objects and
  arrays), ``</function>\\n</tool_call>``; content first as ``\\n`` + content|trim + ``\\n``; results as
  ``<tool_response>\\n...\\n</tool_response>\\n`` in one user turn.
- ``llama3_json``: Llama 3.1's (its tokenizer_config.json, vLLM's tool_chat_template_llama3.1_json.jinja): exactly one
  call, ``{"name": "NAME", "parameters": ARGS|tojson}``, content not rendered; a result as an ``ipython`` message.
- ``mistral``: the v11+ form of Mistral's templates (Magistral, Devstral Small 2, Ministral 3): content, then per call
  ``[TOOL_CALLS]NAME[ARGS]`` + arguments|tojson, then EOS; a result as ``[TOOL_RESULTS]...[/TOOL_RESULTS]``.
- ``deepseek_v3``: DeepSeek-V3's (vLLM's tool_chat_template_deepseekv3.jinja): content, ``<｜tool▁calls▁begin｜>``,
  per call ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS|tojson\\n```<｜tool▁call▁end｜>`` joined by
  ``\\n``, ``<｜tool▁calls▁end｜>``, EOS; results as ``<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>...`` .
- ``glm45``: GLM-4.5/4.6's: the role token ``<|assistant|>`` (here ``<|im_start|>assistant``) followed by
  ``\\n<think></think>`` (a history message without its reasoning), ``\\n`` + content|trim, then per call
  ``\\n<tool_call>NAME\\n`` + per argument ``<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n`` + ``</tool_call>``;
  the generation prompt ``<|assistant|>`` (+ ``\\n<think></think>`` with thinking off); results as ``<|observation|>``
  + ``\\n<tool_response>\\n...\\n</tool_response>``.
- ``glm47``: GLM-4.7's (GLM-5's alike): ``<|assistant|></think>`` (no reasoning), content|trim, per call
  ``<tool_call>NAME`` + ``<arg_key>K</arg_key><arg_value>V</arg_value>``... + ``</tool_call>``, no separator between
  calls; the generation prompt ``<|assistant|>`` + ``</think>`` with thinking off (``<think>`` with it on); results as
  ``<|observation|><tool_response>...</tool_response>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvshuttle.workers import agent_script as script

# The agent model's system prompt and tool list: agent_script's header without its hermes call instruction (each
# family's own call syntax is what the grammar forces).
_HEADER = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
)
_PLAIN = (  # a system (after the first), user or developer message; an assistant message without calls
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role in ['user', 'system', 'developer'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
)
_CALL = "{%- set fn = call.function if call.function is defined else call %}"
_CONTENT = "{%- set content = message.content if message.content is string else '' %}"


def _template(assistant: str, tool: str, generation: str) -> str:
    """A whole template: the agent model's header and plain messages, the family's ``assistant`` branch (an assistant
    message, with or without calls), its ``tool`` branch and what its ``generation`` prompt adds."""
    return (
        _HEADER
        + "{%- for message in messages %}"
        + _PLAIN
        + "{%- elif message.role == 'assistant' %}" + _CONTENT + assistant
        + "{%- elif message.role == 'tool' %}" + tool
        + "{%- else %}{{- raise_exception('unknown role: ' + message.role) }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}" + generation + "{%- endif %}"
    )


_QWEN3_CODER = _template(
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.tool_calls %}"
    "{%- if content | trim | length > 0 %}{{- '\\n' + content | trim + '\\n' }}{%- endif %}"
    "{%- for call in message.tool_calls %}" + _CALL +
    "{{- '\\n<tool_call>\\n<function=' + fn.name + '>\\n' }}"
    "{%- for args_name, args_value in fn.arguments | items %}"
    "{{- '<parameter=' + args_name + '>\\n' }}"
    "{%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and "
    "args_value is not string) else args_value | string %}"
    "{{- args_value }}{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- else %}{{- '\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}",
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user\\n' }}{%- endif %}"
    "{{- '<tool_response>\\n' + message.content + '\\n</tool_response>\\n' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}",
    "{{- '<|im_start|>assistant\\n' }}",
)

_LLAMA3_JSON = _template(
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.tool_calls %}"
    "{%- if message.tool_calls | length != 1 %}"
    "{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{%- set fn = message.tool_calls[0].function %}"
    "{{- '{\"name\": \"' + fn.name + '\", ' + '\"parameters\": ' + fn.arguments | tojson + '}' }}"
    "{%- else %}{{- content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}",
    "{{- '<|im_start|>ipython\\n' }}"
    "{%- if message.content is mapping or (message.content is iterable and message.content is not string) %}"
    "{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}",
    "{{- '<|im_start|>assistant\\n' }}",
)

_MISTRAL = _template(
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for call in message.tool_calls or [] %}" + _CALL +
    "{%- set arguments = fn.arguments %}"
    "{%- if arguments is not string %}{%- set arguments = arguments | tojson | safe %}"
    "{%- elif arguments == '' %}{%- set arguments = '{}' %}{%- endif %}"
    "{{- '[TOOL_CALLS]' + fn.name + '[ARGS]' + arguments }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}",
    "{{- '<|im_start|>tool\\n[TOOL_RESULTS]' + message.content | string + '[/TOOL_RESULTS]<|im_end|>\\n' }}",
    "{{- '<|im_start|>assistant\\n' }}",
)

_DEEPSEEK_V3 = _template(
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- if message.tool_calls %}"
    "{{- '<｜tool▁calls▁begin｜>' }}"
    "{%- for call in message.tool_calls %}" + _CALL +
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<｜tool▁call▁begin｜>' + (call.type or 'function') + '<｜tool▁sep｜>' + fn.name + '\\n' + '```json' + '\\n'"
    " + fn.arguments | tojson + '\\n' + '```' + '<｜tool▁call▁end｜>' }}"
    "{%- endfor %}"
    "{{- '<｜tool▁calls▁end｜>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}",
    "{%- if loop.first or loop.previtem.role != 'tool' %}"
    "{{- '<|im_start|>tool\\n<｜tool▁outputs▁begin｜>' }}{%- else %}{{- '\\n' }}{%- endif %}"
    "{{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<｜tool▁outputs▁end｜><|im_end|>\\n' }}{%- endif %}",
    "{{- '<|im_start|>assistant\\n' }}",
)

_GLM_VALUE = "{{- v | tojson(ensure_ascii=False) if v is not string else v }}"
_GLM45 = _template(
    "{{- '<|im_start|>assistant' }}"
    "{{- '\\n<think></think>' }}"
    "{%- if content.strip() %}{{- '\\n' + content.strip() }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}" + _CALL +
    "{{- '\\n<tool_call>' + fn.name + '\\n' }}"
    "{%- for k, v in fn.arguments.items() %}"
    "{{- '<arg_key>' + k + '</arg_key>\\n<arg_value>' }}" + _GLM_VALUE + "{{- '</arg_value>\\n' }}"
    "{%- endfor %}"
    "{{- '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}",
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>observation' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}",
    "{{- '<|im_start|>assistant' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '\\n<think></think>' }}{%- endif %}",
)

_GLM47 = _template(
    "{{- '<|im_start|>assistant' }}"
    "{{- '</think>' }}"
    "{%- if content.strip() %}{{- content.strip() }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}" + _CALL +
    "{{- '<tool_call>' + fn.name }}"
    "{%- for k, v in fn.arguments.items() %}"
    "{{- '<arg_key>' + k + '</arg_key><arg_value>' }}" + _GLM_VALUE + "{{- '</arg_value>' }}"
    "{%- endfor %}"
    "{{- '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}",
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>observation' }}{%- endif %}"
    "{{- '<tool_response>' + message.content + '</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}",
    "{{- '<|im_start|>assistant' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '</think>' }}{%- else %}{{- '<think>' }}"
    "{%- endif %}",
)


@dataclass(frozen=True)
class FamilyTemplate:
    """One family's gateway: its ``--tool-call-parser``, the test template, and the ``chat_template_kwargs`` its
    requests send (GLM's templates open a reasoning block in the generation prompt unless thinking is off)."""

    parser: str
    template: str
    template_kwargs: dict[str, Any] = field(default_factory=dict)


NO_THINKING = {"enable_thinking": False}
FAMILY_TEMPLATES: dict[str, FamilyTemplate] = {
    "hermes": FamilyTemplate("hermes", script.chat_template("echo")),
    "qwen3_json": FamilyTemplate("qwen3_json", script.chat_template("qwen3")),
    "qwen3_coder": FamilyTemplate("qwen3_coder", _QWEN3_CODER),
    "llama3_json": FamilyTemplate("llama3_json", _LLAMA3_JSON),
    "mistral": FamilyTemplate("mistral", _MISTRAL),
    "deepseek_v3": FamilyTemplate("deepseek_v3", _DEEPSEEK_V3),
    "glm45": FamilyTemplate("glm45", _GLM45, NO_THINKING),
    "glm47": FamilyTemplate("glm47", _GLM47, NO_THINKING),
}
