"""The gateway renders chat templates through a sandbox with fast paths (tokenizer._ChatTemplateEnvironment): the text
must be byte-identical to a plain jinja2 ``ImmutableSandboxedEnvironment`` render (transformers' environment) of the
same template, for conversations with tools, tool calls, tool results and reasoning; errors must be the same, and
what the sandbox refuses it must still refuse.

Needs only jinja2 and tokenizers (a one-token tokenizer.json is written per template): no model, no transformers.
"""

from __future__ import annotations

import copy
import functools
import json
import re

import jinja2
import pytest
from jinja2.runtime import LoopContext, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment
from kvshuttle.services.gateway.tokens import tokenizer as gt
from kvshuttle.workers import agent_script as script
from kvshuttle.workers import model_builder
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

# -- templates ------------------------------------------------------------------------------------------------------

QWEN25_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within " }}
    {{- "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": " }}
    {{- "<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or
           (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen3's: reasoning kept after the last real user query, namespace, reversed history, str methods, {% generation %}.
QWEN3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and
           not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
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
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'
                    + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- generation %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {%- endgeneration %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Llama 3.1's: bos_token, trim, slicing, `in` on a dict, tojson(indent=4), mapping/iterable tests, one call a turn.
LLAMA31_TEMPLATE = """\
{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# What the fast paths touch besides plain key reads: dict methods, keys shadowing them, underscore keys, loop
# attributes and methods, str methods and the wrapped str.format, missing keys (undefined), sorted tojson.
ODD_TEMPLATE = """\
{%- for message in messages %}
{{- loop.index }}/{{ loop.length }} {{ loop.revindex0 }} {{ loop.depth }} {{ loop.cycle('a', 'b') }}
{{- ' changed' if loop.changed(message.role) }}
{{- ' prev=' + loop.previtem.role if not loop.first }} {{ ' next=' + loop.nextitem.role if not loop.last }}
{{- ' ' + message.role.upper() + ' ' + message.role.title() + ' {}:{}'.format(loop.index0, message.role) }}
{{- ' keys=' + (message.keys() | list | join(',')) + ' n=' + (message.items() | list | length | string) }}
{{- ' get=' + message.get('missing', 'dflt') + ' ' + (message.get('role') or '') }}
{{- ' under=' + (message._private | string) + ' undef=' + (message.nope is defined | string) }}
{{- ' content=' + ((message.content or '') | trim | replace('\\n', ' ') | truncate(40)) }}
{{- ' split=' + ((message.content or '').split(' ') | length | string) }}
{%- if message.tool_calls %}{% for call in message.tool_calls %} {{ call.function.name }}
{{- call.function.arguments | tojson(sort_keys=true) if call.function.arguments is mapping
    else call.function.arguments }}{% endfor %}{% endif %}
{{- '\\n' }}
{%- endfor %}
{{- tools | tojson(indent=2) if tools }} {{ documents }} {{ eos_token }} {{ bos_token is defined }}
"""

TEMPLATES = {
    "agent": script.AGENT_CHAT_TEMPLATE,
    "tiny": model_builder.CHAT_TEMPLATE,
    "qwen2.5": QWEN25_TEMPLATE,
    "qwen3": QWEN3_TEMPLATE,
    "llama3.1": LLAMA31_TEMPLATE,
    "odd": ODD_TEMPLATE,
}

# -- conversations --------------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city — «aujourd'hui» 🌦",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}


def _call(name: str, args: dict, as_string: bool, call_id: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args) if as_string else args}}


CONVERSATIONS = {
    "agent-script": (script.messages_after(len(script.AGENT.steps), script.AGENT), script.TOOLS),
    "plain": ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi\n  there "},
               {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Grüße 日本 🚀"}], None),
    "tools": ([
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "Weather in Köln and Paris, and the time?"},
        {"role": "assistant", "content": "", "reasoning_content": "\nTwo cities, one clock.\n",
         "tool_calls": [_call("get_weather", {"city": "Köln"}, False, "c1"),
                        _call("get_weather", {"city": "Paris", "unit": "c"}, True, "c2"),
                        _call("get_time", {"tz": "Europe/Paris"}, False, "c3")]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 3, "sky": "grau"}'},
        {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 5}'},
        {"role": "tool", "tool_call_id": "c3", "content": "09:41"},
        {"role": "assistant", "content": "\nKöln 3 °C, Paris 5 °C; it is 09:41.", "reasoning_content": "All in.",
         "reasoning": "All in."},
        {"role": "user", "content": "<tool_response>\nnot really one\n</tool_response>"},
        {"role": "assistant", "content": "<think>\nold style\n</think>\n\nOk.", "reasoning_content": None},
        {"role": "user", "content": "And tomorrow?"},
    ], [WEATHER, TIME]),
    "one-call-a-turn": ([
        {"role": "system", "content": "  Weather bot.  "},
        {"role": "user", "content": "Rain in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Oslo"}, False, "x")]},
        {"role": "tool", "tool_call_id": "x", "content": "rain"},
        {"role": "assistant", "content": "Yes, rain.", "reasoning_content": "It said rain."},
        {"role": "user", "content": "Thanks"},
    ], [WEATHER]),
    "tool-first": ([{"role": "user", "content": "go"},
                    {"role": "assistant", "content": None, "tool_calls": [_call("get_time", {}, True, "t")]},
                    {"role": "tool", "content": "noon"}], [TIME]),
    "unknown-role": ([{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}], None),
}
EXTRAS = [{}, {"enable_thinking": False}, {"enable_thinking": True, "date_string": "01 Jan 2030"}]
# Where both renderers fail (an unknown role; content None in templates that add it; Llama's one call a turn).
REFUSED = {("agent", "unknown-role"), ("tiny", "unknown-role"), ("tiny", "agent-script"), ("tiny", "tool-first"),
           ("llama3.1", "agent-script"), ("llama3.1", "tools")}


# -- the two renderers ----------------------------------------------------------------------------------------------


def _model_dir(tmp_path_factory, name: str, template: str):
    root = tmp_path_factory.mktemp(f"model-{name}")
    Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(root / "tokenizer.json"))
    (root / "chat_template.jinja").write_text(template)
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": None}))
    return root


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return {name: gt.GatewayTokenizer(_model_dir(tmp_path_factory, name, t)) for name, t in TEMPLATES.items()}


@functools.cache
def _reference_template(template: str) -> jinja2.Template:
    """The template in a plain ImmutableSandboxedEnvironment, set up as transformers sets up its own."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[gt._GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = gt._tojson
    env.globals["raise_exception"] = gt._raise_exception
    env.globals["strftime_now"] = gt._strftime_now
    return env.from_string(template)


def _outcome(render, *args, **kwargs) -> tuple[str, str]:
    """What a render gave: its text or its error, with object addresses masked (a probe that prints a bound method
    prints a new object each time, at whatever address the allocator gives it)."""
    try:
        return "text", _ADDRESS.sub(" at 0x…", render(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 (the two renderers must fail alike)
        cause = exc.__cause__ if isinstance(exc, gt.ChatTemplateError) and exc.__cause__ else exc
        return type(cause).__name__, _ADDRESS.sub(" at 0x…", str(cause))


_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _reference_render(tok: gt.GatewayTokenizer, messages, add_generation_prompt, **extra) -> str:
    variables = {"tools": None, "documents": None}
    variables.update((k, v) for k, v in tok.special_tokens.items() if v is not None)
    variables.update(extra)
    return _reference_template(tok.chat_template).render(messages=list(messages),
                                                         add_generation_prompt=add_generation_prompt, **variables)


def test_uses_the_fast_sandbox(tokenizers):
    env = tokenizers["agent"]._template.environment
    assert isinstance(env, gt._ChatTemplateEnvironment) and isinstance(env, ImmutableSandboxedEnvironment)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("template", TEMPLATES)
def test_render_is_byte_identical_to_the_plain_sandbox(tokenizers, template, conversation):
    tok = tokenizers[template]
    messages, tools = CONVERSATIONS[conversation]
    before = copy.deepcopy(messages)
    rendered = 0
    for add_generation_prompt in (True, False):
        for extra in EXTRAS:
            kwargs = {**extra, **({"tools": tools} if tools else {})}
            want = _outcome(_reference_render, tok, messages, add_generation_prompt, **kwargs)
            got = _outcome(tok.render_chat, messages, add_generation_prompt, **kwargs)
            assert got == want
            rendered += want[0] == "text"
            # Every prefix of the conversation too (the gateway renders each turn's history).
            for n in range(1, len(messages)):
                assert _outcome(tok.render_chat, messages[:n], add_generation_prompt, **kwargs) == \
                    _outcome(_reference_render, tok, messages[:n], add_generation_prompt, **kwargs)
    assert messages == before  # rendering changed nothing
    assert rendered == (0 if (template, conversation) in REFUSED else 2 * len(EXTRAS))  # not all errors alike


def test_the_agent_conversation_renders_as_in_the_bench(tokenizers):
    """Each step of the agent script as the bench renders it (its history grows; tools every turn)."""
    tok = tokenizers["agent"]
    history = [{"role": "system", "content": script.SYSTEM}]
    for step in range(len(script.TURNS)):
        history += script.inputs(step)
        assert tok.render_chat(history, True, tools=script.TOOLS) == \
            _reference_render(tok, history, True, tools=script.TOOLS)
        history.append(script.assistant_message(step))


# What the sandbox refuses, it still refuses (the fast paths serve only plain keys, str methods and loop attributes).
SANDBOX_PROBES = [
    "{{ messages[0].__class__ }}",
    "{{ messages[0].__class__.__mro__ }}",
    "{{ messages[0].content.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages[0].content.strip.__self__ }}",
    "{{ messages[0].content.format.__globals__ }}",
    "{{ '{0.__class__}'.format(messages[0].content) }}",
    "{{ messages[0].content.format_map({}) }}",
    "{{ messages[0].clear() }}",
    "{{ messages[0].update({'role': 'x'}) }}{{ messages[0].role }}",
    "{{ messages[0].pop('role') }}",
    "{{ messages.append(1) }}",
    "{% for m in messages %}{{ loop.__class__ }}{{ loop._iterator }}{% endfor %}",
    "{% for m in messages %}{{ loop.cycle.__func__ }}{% endfor %}",
    "{{ messages[0]._private }}{{ messages[0].__init__ }}",
    "{% for f in [messages[0].content.format, 'x'] %}{{ loop.nextitem }}{{ loop.previtem }}{% endfor %}",
    "{{ raise_exception.__globals__ }}",
]


@pytest.mark.parametrize("probe", SANDBOX_PROBES)
def test_sandbox_refuses_the_same(tmp_path_factory, probe):
    tok = gt.GatewayTokenizer(_model_dir(tmp_path_factory, "probe", probe))
    messages = [{"role": "user", "content": "hi {0}", "_private": "p"}]
    want = _outcome(_reference_render, tok, messages, True)
    assert _outcome(tok.render_chat, messages, True) == want
    assert messages == [{"role": "user", "content": "hi {0}", "_private": "p"}]


def _same(a, b) -> bool:
    if isinstance(a, Undefined) or isinstance(b, Undefined):
        return type(a) is type(b) and a._undefined_name == b._undefined_name \
            and a._undefined_exception is b._undefined_exception and a._undefined_hint == b._undefined_hint
    # The sandbox wraps str.format anew on each access: compare what it wraps.
    return type(a) is type(b) and getattr(a, "__wrapped__", a) == getattr(b, "__wrapped__", b)


def test_getattr_matches_the_plain_sandbox_name_by_name():
    ours, plain = gt._ChatTemplateEnvironment(), ImmutableSandboxedEnvironment()
    message = {"role": "user", "items": "shadowed", "_x": 1, "__class__": "key", "get": "key"}
    names = {*dir(dict), *dir(str), *dir(LoopContext), *message, "role", "missing", "format", "format_map"}
    for obj in (message, "text"):
        for name in sorted(names):
            assert _same(ours.getattr(obj, name), plain.getattr(obj, name)), (type(obj).__name__, name)
    # A loop's items may be anything the caller passed, a bare str.format too: the sandbox must still wrap it.
    for _item, loop in LoopContext(iter(["a", "{0.__class__}".format, "c"]), Undefined):
        for name in sorted(names):
            assert _same(ours.getattr(loop, name), plain.getattr(loop, name)), ("loop", loop.index0, name)
