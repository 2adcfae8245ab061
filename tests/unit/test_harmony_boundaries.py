"""gpt-oss's Harmony: its chat template drops the `analysis` of a tool loop once a final answer follows it, and renders
a final answer's end as <|end|> where the model wrote <|return|>. So a new question re-renders the whole previous
loop differently, and the turn must continue the session from where that loop began (the record's loop-start
boundary), pulling the longest common prefix. The gateway's prompt and record stages, on a byte-level tokenizer with
Harmony's special tokens and a template that follows gpt-oss's chat_template.jinja in what it keeps and drops (no
gpt-oss model runs here)."""

from __future__ import annotations

import json

from kvshuttle.control_plane.continuation import common_prefix, text_key
from kvshuttle.services.engine.client import Final
from kvshuttle.services.gateway.tokens.tokenizer import GatewayTokenizer
from kvshuttle.services.gateway.turns import TurnContext, TurnRequest, TurnRunner
from kvshuttle.services.gateway.turns import prompt as prompt_stage
from kvshuttle.services.gateway.turns import record as record_stage
from kvshuttle.services.gateway.turns.spans import tracer
from kvshuttle.v1 import common_pb2, scheduler_pb2

from tests.support.turn_fakes import Registry, Scheduler

SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>",
           "<|endoftext|>"]
# As gpt-oss's template: a tool-call message keeps its analysis (here the gateway's reasoning_content) only while no
# final answer follows it; final answers are rendered without their analysis, ending <|end|>.
HARMONY_TEMPLATE = (
    "{%- set ns = namespace(tool='') -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}<|start|>developer<|message|># Instructions\n\n{{ message.content }}<|end|>"
    "{%- elif message.role == 'user' -%}<|start|>user<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'tool' -%}"
    "<|start|>functions.{{ ns.tool }} to=assistant<|channel|>commentary<|message|>{{ message.content }}<|end|>"
    "{%- elif message.tool_calls -%}"
    "{%- set future = namespace(final=false) -%}"
    "{%- for later in messages[loop.index:] -%}"
    "{%- if later.role == 'assistant' and not later.tool_calls -%}{%- set future.final = true -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if message.reasoning_content and not future.final -%}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ message.reasoning_content }}<|end|>"
    "{%- endif -%}"
    "{%- set call = message.tool_calls[0].function -%}{%- set ns.tool = call.name -%}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>{{ call.arguments }}<|call|>"
    "{%- else -%}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
ARGS = '{"city": "Paris"}'
# What the model generates at each step (after the generation prompt "<|start|>assistant")
CALL = ("<|channel|>analysis<|message|>The user wants Paris.<|end|><|start|>assistant to=functions.get_weather"
        f"<|channel|>commentary json<|message|>{ARGS}<|call|>")
FINAL = "<|channel|>analysis<|message|>The tool says sunny.<|end|><|start|>assistant<|channel|>final<|message|>" \
        "Sunny in Paris.<|return|>"


def harmony_tokenizer(tmp_path) -> GatewayTokenizer:
    """Byte-level tokens (no merges) and Harmony's special tokens; <|return|> and <|call|> end an answer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": HARMONY_TEMPLATE,
                                                                "eos_token": "<|return|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [
        tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]}))
    return GatewayTokenizer(tmp_path)


async def turn(r: TurnRunner, messages: list[dict], answer: str) -> TurnContext:
    """One turn without a session id through the prompt stage, then D's answer ``answer`` recorded."""
    ctx = TurnContext("t", TurnRequest(messages=messages), 0.0, span=tracer.start_span("test"))
    await prompt_stage.build(r, ctx)
    ctx.plan = scheduler_pb2.PlanTurnResponse(decode=common_pb2.Worker(worker_id="d", grpc_address="d:1"))
    ctx.output_ids, ctx.text = r.tokenizer.encode(answer), answer  # Harmony's markers kept in the text
    n = len(ctx.prompt_ids) + len(ctx.output_ids) - 1
    ctx.final = Final(ctx.output_ids, "stop", len(ctx.prompt_ids), len(ctx.output_ids), 0, {
        "do_remote_decode": True, "remote_block_ids": [list(range(n // 16 + 1))], "remote_engine_id": "e",
        "remote_host": "h", "remote_port": 1, "remote_num_tokens": n})
    await record_stage.run(r, ctx)
    return ctx


async def test_a_new_question_after_a_harmony_tool_loop_continues_from_where_the_loop_began(tmp_path):
    tok = harmony_tokenizer(tmp_path)
    assert "<|end|>" in tok.end_markers and "<|call|>" in tok.end_markers
    registry = Registry()
    r = TurnRunner(tok, registry, Scheduler(scheduler_pb2.DECISION_RECOMPUTE), max_model_len=10000)
    r.find_sessions = True
    ask = [{"role": "system", "content": "You are a weather assistant."},
           {"role": "user", "content": "Weather in Paris?"}]
    first = await turn(r, ask, CALL)
    assert first.request.session_source == "new"
    call = {"role": "assistant", "content": None, "reasoning_content": "The user wants Paris.",
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]}
    loop = [*ask, call, {"role": "tool", "tool_call_id": "c0", "content": "sunny"}]
    # inside the loop the analysis is kept: the echoed history re-renders what was generated, all of it continued
    second = await turn(r, loop, FINAL)
    assert second.request.session_source == "found" and second.history_kept == len(first.prompt_ids) + len(
        first.output_ids)
    # its record keeps where the loop began: the first prompt's last message's end, before "<|start|>assistant"
    start = registry.session.text_boundaries[0]
    assert start.loop_start and start.chars == len(first.prompt_text) - len("<|start|>assistant")
    assert start.tokens == len(first.prompt_ids) - len(tok.encode("<|start|>assistant"))
    # a new question: the loop's analysis goes (a final answer follows it) and the final ends <|end|>, not <|return|>
    final = {"role": "assistant", "content": "Sunny in Paris.", "reasoning_content": "The tool says sunny."}
    third_messages = [*loop, final, {"role": "user", "content": "And Oslo?"}]
    rendered = tok.render_chat(third_messages, True)
    assert "The user wants Paris." not in rendered and "Sunny in Paris.<|end|>" in rendered
    held = registry.history  # the decode worker's ids for turn 2 (all of it as recorded)
    third = await turn(r, third_messages, CALL)
    assert third.request.session_source == "found" and third.continued
    (boundary,) = [b for b in registry.recorded[-2].text_boundaries if b.loop_start]
    assert third.history_kept == boundary.tokens and boundary.key == text_key(rendered[:boundary.chars])
    assert rendered[:boundary.chars].endswith("Weather in Paris?<|end|>")
    # the scheduler is told the longest common prefix of the prompt with the held ids: the loop's start and the
    # generation prompt's "<|start|>assistant", up to where the analysis was
    match = third.known_session.history_match_tokens
    assert match == common_prefix(third.prompt_ids, held) > boundary.tokens
    assert tok.decode(third.prompt_ids[boundary.tokens:match], False) == "<|start|>assistant"
