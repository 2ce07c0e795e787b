"""Tool calling on the server's chat endpoint: the tools reach the chat template, a required or named
``tool_choice`` constrains the output to a call whose arguments follow the function's schema (answered as
``message.tool_calls``), an unknown function name or a streamed call is a 400, and ``role: "tool"`` answers and
assistant ``tool_calls`` render in the conversation."""

from __future__ import annotations

import json

import openai
import pytest
import servekit
import test_structured as ts
import tiny

import batchspec
from batchspec.serve import protocol as P

WEATHER = {"type": "function", "function": {"name": "get", "description": "a number and a word",
                                            "parameters": ts.SCHEMA}}
OTHER = {"type": "function", "function": {"name": "put", "parameters": {
    "type": "object", "required": ["c"], "properties": {"c": {"type": "boolean"}}, "additionalProperties": False}}}
# spelled with the characters of the tokenizer's vocabulary (no spaces): tools, then role:content. per message
TEMPLATE = ("{% if tools %}tools:{% for t in tools %}{{ t.function.name }},{% endfor %}.{% endif %}"
            "{% for m in messages %}{{ m.role }}:{{ m.content }}"
            "{% for c in m.tool_calls or [] %}call:{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
            "{% if m.tool_call_id %}id:{{ m.tool_call_id }}{% endif %}.{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
USER = [{"role": "user", "content": "weather"}]


def tokenizer():
    """The character-level JSON tokenizer of the structured-output tests, with a chat template that renders tools."""
    tok = ts.tokenizer.__wrapped__()
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def server():
    llm = batchspec.LLM(tiny.target(), draft=tiny.draft(), scheduler="continuous", num_draft_tokens=3, batch_size=4,
                        tokenizer=tokenizer())
    with servekit.served(llm) as s:
        yield s


def _create(server, **kw):
    kw.setdefault("messages", USER)
    kw.setdefault("max_tokens", 120)
    return servekit.client(server.url).chat.completions.create(model="tiny", **kw)


def _valid_call(call, name: str) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    return json.loads(call.function.arguments)


@pytest.mark.parametrize("temperature", [0, 0.9])
def test_required_with_one_tool_returns_a_call_that_follows_its_schema(server, temperature):
    r = _create(server, tools=[WEATHER], tool_choice="required", temperature=temperature, seed=4)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert ts._valid(json.dumps(_valid_call(call, "get")))
    free = _create(server, tools=[WEATHER], temperature=temperature, seed=4)  # auto: the output as it comes
    assert free.choices[0].message.tool_calls is None and free.choices[0].finish_reason != "tool_calls"
    assert free.choices[0].message.content  # the grammar is what makes it a call


def test_a_named_tool_and_required_over_several(server):
    r = _create(server, tools=[WEATHER, OTHER], temperature=0,
                tool_choice={"type": "function", "function": {"name": "put"}})
    [call] = r.choices[0].message.tool_calls
    assert set(_valid_call(call, "put")) == {"c"} and r.choices[0].finish_reason == "tool_calls"
    for seed in range(3):
        r = _create(server, tools=[WEATHER, OTHER], tool_choice="required", temperature=1.0, seed=seed)
        [call] = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert ts._valid(json.dumps(args)) if call.function.name == "get" else set(args) == {"c"}


def test_tools_reach_the_chat_template(server):
    r = _create(server, tools=[WEATHER, OTHER], tool_choice="none", temperature=0, max_tokens=4,
                extra_body={"return_token_ids": True})
    text = tokenizer().decode(r.choices[0].model_extra["prompt_token_ids"])
    assert text == "tools:get,put,.user:weather.assistant:"
    assert r.choices[0].message.tool_calls is None


def test_tool_messages_are_accepted(server):
    msgs = USER + [{"role": "assistant", "content": None, "tool_calls": [
                       {"id": "call_1", "type": "function", "function": {"name": "get",
                                                                         "arguments": '{"a":1,"b":"x"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = _create(server, messages=msgs, tools=[WEATHER], temperature=0, max_tokens=4,
                extra_body={"return_token_ids": True})
    text = tokenizer().decode(r.choices[0].model_extra["prompt_token_ids"])
    assert text == 'tools:get,.user:weather.assistant:call:get{"a": 1, "b": "x"}.tool:sunnyid:call_1.assistant:'


@pytest.mark.parametrize("body, param", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools[0]"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(tools=[WEATHER], stream=True), "stream"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
          tool_choice="required"), "tools"),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages[0].tool_calls"),
    (dict(functions=[{"name": "f"}]), "functions"),
])
def test_bad_tool_fields_name_the_field(server, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        _create(server, **body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_auto_parses_a_call_or_leaves_content():
    funcs = [WEATHER["function"], OTHER["function"]]
    for text in ('{"name": "put", "arguments": {"c": true}}', '<tool_call>\n{"name":"put","arguments":{"c":true}}\n'
                 '</tool_call>', '[{"name": "put", "parameters": {"c": true}}]'):
        [call] = P.tool_calls(text, funcs)
        assert call["function"] == {"name": "put", "arguments": '{"c": true}'} and call["type"] == "function"
    two = P.tool_calls('<tool_call>{"name":"put","arguments":{}}</tool_call><tool_call>{"name":"get","arguments":'
                       '{"a":1}}</tool_call>', funcs)
    assert [c["function"]["name"] for c in two] == ["put", "get"] and two[0]["id"] != two[1]["id"]
    for text in ("hello", '{"name": "nope", "arguments": {}}', '{"name": "put"}', "see <tool_call>{}</tool_call>",
                 '{"name": "put", "arguments": "x"}', "[1]"):
        assert P.tool_calls(text, funcs) is None


@pytest.mark.parametrize("temperature", [0, 0.9])
def test_the_openai_clients_parse_fills_a_pydantic_model(server, temperature):
    """The official client's ``beta.chat.completions.parse`` with a pydantic model (sent as OpenAI's strict JSON
    schema) gets its model back filled in; the text is laid out as ``json.dumps`` lays out the same value."""
    import pydantic

    class Reading(pydantic.BaseModel):
        a: int = pydantic.Field(ge=0, le=99)
        b: str = pydantic.Field(max_length=3)

    r = servekit.client(server.url).beta.chat.completions.parse(
        model="tiny", messages=USER, response_format=Reading, max_tokens=120, temperature=temperature, seed=3)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(message.parsed, Reading)
    assert message.content == json.dumps(message.parsed.model_dump())
