"""The GLM-4.5, MiniMax-M2, Qwen3-Coder, DeepSeek-V3/V3.1/R1 and Kimi-K2 call layouts, written as
each family's released chat template writes them: whole outputs, malformed ones (back whole as
content), every split of an output through the server's splitter giving the whole text's answer
(arguments streamed as written for the JSON layouts, each call whole once closed for the tagged
ones), calls rendered and read back, the family found from a template's cue, and the reasoning
block these models write before their calls."""

from __future__ import annotations

import json

import pytest

from gateway_service.chat_format import ChatFormat, plan_chat
from gateway_service.chat_output import ChatOutputSplitter, ToolCallSplitter
from gateway_service.config import GatewayConfig
from gateway_service.errors import InvalidRequest
from gateway_service.reasoning import ReasoningSplitter, detect_reasoning
from gateway_service.tool_parsers import (
    PARSERS,
    DeepSeekV3Parser,
    DeepSeekV31Parser,
    Glm45Parser,
    HermesParser,
    KimiK2Parser,
    MiniMaxM2Parser,
    Qwen3CoderParser,
    detect_tool_parser,
    tool_parser,
)
from radixserve.constraints import ConstraintKind
from radixserve.v1 import generation_pb2 as pb

WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"zone": "CET"})
# Every JSON type, and text with a newline, quotes and non-ASCII characters; `"quoted"` is text
# (quotes included), not the JSON string it spells.
TYPES = ("set", {"n": 3, "x": -2.5, "on": True, "off": None, "list": [1, "a"], "obj": {"k": [False]},
                 "text": 'line one\nline "two" — ünï ☀', "quoted": '"quoted"'})
# The values of TYPES as the tagged layouts write them.
TYPE_VALUES = [("n", "3"), ("x", "-2.5"), ("on", "true"), ("off", "null"), ("list", '[1, "a"]'),
               ("obj", '{"k": [false]}'), ("text", 'line one\nline "two" — ünï ☀'), ("quoted", '"quoted"')]
# DeepSeek's markers spelled out: full-width bars (U+FF5C), U+2581 between words.
DS_BEGIN, DS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL, DS_SEP, DS_CALL_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581sep\uff5c>", \
    "<\uff5ctool\u2581call\u2581end\uff5c>"
K_BEGIN, K_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def glm(name: str, pairs: list[tuple[str, str]]) -> str:
    return f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                                            for k, v in pairs) + "</tool_call>"


def invoke(name: str, pairs: list[tuple[str, str]]) -> str:
    return f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in pairs) \
        + "</invoke>\n"


def minimax(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


def qwen(name: str, pairs: list[tuple[str, str]]) -> str:
    return f"<tool_call>\n<function={name}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in pairs) \
        + "</function>\n</tool_call>"


def ds31(name: str, args: str) -> str:
    return f"{DS_CALL}{name}{DS_SEP}{args}{DS_CALL_END}"


def ds3(name: str, args: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


def kimi(header: str, args: str) -> str:
    return f"<|tool_call_begin|>{header}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


W_PAIRS, T_PAIRS = [("city", "Paris"), ("unit", "celsius")], [("zone", "CET")]
W_JSON, T_JSON, TYPES_JSON = (json.dumps(c[1], ensure_ascii=False) for c in (WEATHER, TIME, TYPES))

# (parser, output, content, calls)
RECORDED = [
    (Glm45Parser, glm("get_weather", W_PAIRS), "", (WEATHER,)),
    (Glm45Parser, f"{glm('get_weather', W_PAIRS)}\n{glm('get_time', T_PAIRS)}", "", (WEATHER, TIME)),
    (Glm45Parser, f"Let me look.\n{glm('get_time', T_PAIRS)}", "Let me look.\n", (TIME,)),
    (Glm45Parser, glm("set", TYPE_VALUES), "", (TYPES,)),
    (Glm45Parser, "<tool_call>get_time\n</tool_call>", "", (("get_time", {}),)),
    (MiniMaxM2Parser, minimax(invoke("get_weather", W_PAIRS)), "", (WEATHER,)),
    (MiniMaxM2Parser, minimax(invoke("get_weather", W_PAIRS), invoke("get_time", T_PAIRS)), "", (WEATHER, TIME)),
    (MiniMaxM2Parser, f"Let me look.\n\n{minimax(invoke('set', TYPE_VALUES))}", "Let me look.\n\n", (TYPES,)),
    (Qwen3CoderParser, qwen("get_weather", W_PAIRS), "", (WEATHER,)),
    (Qwen3CoderParser, f"{qwen('get_weather', W_PAIRS)}\n{qwen('get_time', T_PAIRS)}", "", (WEATHER, TIME)),
    (Qwen3CoderParser, f"I will check.\n\n{qwen('set', TYPE_VALUES)}", "I will check.\n\n", (TYPES,)),
    (DeepSeekV31Parser, DS_BEGIN + ds31("get_weather", W_JSON) + DS_END, "", (WEATHER,)),
    (DeepSeekV31Parser, DS_BEGIN + ds31("get_weather", W_JSON) + ds31("get_time", T_JSON) + DS_END, "",
     (WEATHER, TIME)),
    (DeepSeekV31Parser, "Checking." + DS_BEGIN + ds31("set", TYPES_JSON) + DS_END, "Checking.", (TYPES,)),
    (DeepSeekV3Parser, DS_BEGIN + ds3("get_weather", W_JSON) + "\n" + ds3("get_time", T_JSON) + DS_END, "",
     (WEATHER, TIME)),
    (DeepSeekV3Parser, "Checking.\n\n" + DS_BEGIN + ds3("set", TYPES_JSON) + DS_END, "Checking.\n\n", (TYPES,)),
    (DeepSeekV31Parser, DS_BEGIN + ds3("get_time", T_JSON) + DS_END, "", (TIME,)),  # V3's layout: read too
    (KimiK2Parser, K_BEGIN + kimi("functions.get_weather:0", W_JSON) + K_END, "", (WEATHER,)),
    (KimiK2Parser, K_BEGIN + kimi("functions.get_weather:0", W_JSON) + kimi("functions.get_time:1", T_JSON) + K_END,
     "", (WEATHER, TIME)),
    (KimiK2Parser, "Sure." + K_BEGIN + kimi(" functions.set:0 ", TYPES_JSON) + K_END, "Sure.", (TYPES,)),
    (KimiK2Parser, K_BEGIN + kimi("get_time:0", T_JSON) + K_END, "", (TIME,)),  # no functions. prefix
]

MALFORMED = [
    (Glm45Parser, "<tool_call>\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>"),  # no name
    (Glm45Parser, "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n"),  # not closed
    (Glm45Parser, "<tool_call>get_time\n<arg_key>zone</arg_key>\n</tool_call>"),  # a key without its value
    (Glm45Parser, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),  # Hermes' layout
    (Glm45Parser, f"{glm('get_time', T_PAIRS)}\n<tool_call>get_weather\n<arg_key>city"),  # the second cut
    (MiniMaxM2Parser, minimax(invoke("", T_PAIRS))),
    (MiniMaxM2Parser, minimax(invoke("get_time", T_PAIRS)).removesuffix("</minimax:tool_call>")),
    (MiniMaxM2Parser, "<minimax:tool_call>\n</minimax:tool_call>"),  # no call in the block
    (MiniMaxM2Parser, minimax(invoke("get_time", T_PAIRS), "and some words\n")),
    (Qwen3CoderParser, qwen("", T_PAIRS)),
    (Qwen3CoderParser, qwen("get_time", T_PAIRS).removesuffix("</tool_call>")),
    (Qwen3CoderParser, "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</function>\n</tool_call>"),
    (DeepSeekV31Parser, DS_BEGIN + ds31("get_time", '{"zone": ') + DS_END),  # bad JSON
    (DeepSeekV31Parser, DS_BEGIN + f"{DS_CALL}get_time{T_JSON}{DS_CALL_END}" + DS_END),  # no separator
    (DeepSeekV31Parser, DS_BEGIN + ds31("get_time", T_JSON)),  # the section not closed
    (DeepSeekV3Parser, DS_BEGIN + ds3("get_time", T_JSON).replace("function", "other") + DS_END),
    (DeepSeekV3Parser, DS_BEGIN + ds31("", T_JSON) + DS_END),  # no name
    (KimiK2Parser, K_BEGIN + kimi("functions.get_time:0", '{"zone": "CET"') + K_END),
    (KimiK2Parser, K_BEGIN + kimi("functions.get_time:0", T_JSON)),
    (KimiK2Parser, K_BEGIN + kimi(":0", T_JSON) + K_END),
    (KimiK2Parser, K_BEGIN + kimi("functions.get_time:0", "[1, 2]") + K_END),  # not an object
]
JSON_LAYOUTS = (DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser)


def _calls(parsed_calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed_calls]


@pytest.mark.parametrize("parser, text, content, calls", RECORDED)
def test_outputs_parse_into_content_and_calls(parser, text, content, calls) -> None:
    parsed = parser().parse(text)
    assert parsed.content == content
    assert _calls(parsed.calls) == list(calls)


@pytest.mark.parametrize("parser, text", MALFORMED)
def test_malformed_outputs_come_back_whole_as_content(parser, text) -> None:
    parsed = parser().parse(text)
    assert parsed.content == text and parsed.calls == ()


def _split_feed(parser, pieces: list[str]) -> tuple[str, tuple]:
    splitter = ToolCallSplitter(parser)
    content = "".join(splitter.feed(piece) for piece in pieces)
    rest, calls = splitter.finish()
    return content + rest, calls


@pytest.mark.parametrize("parser, text", [(p, t) for p, t, _, _ in RECORDED] + MALFORMED)
def test_every_split_gives_the_whole_texts_answer(parser, text) -> None:
    whole = parser().parse(text)
    for cut in range(len(text) + 1):  # every split in two, then pieces of every small size
        assert _split_feed(parser(), [text[:cut], text[cut:]]) == (whole.content, whole.calls), cut
    for size in (1, 2, 3, 5, 8):
        assert _split_feed(parser(), [text[i:i + size] for i in range(0, len(text), size)]) == (
            whole.content, whole.calls), size


def _stream(parser, text: str, size: int, finish: int = pb.FINISH_REASON_STOP) -> tuple[str, dict, list[int]]:
    """`text` as a stream's chunks through `ChatOutputSplitter` with incremental calls: (content,
    per call index its name and argument pieces, per chunk how many call pieces it carried)."""
    splitter = ChatOutputSplitter(None, ToolCallSplitter(parser, incremental=True))
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    content, calls, counts = [], {}, []
    for index, piece in enumerate(pieces):
        chunk = pb.GenerateResponse(text=piece, finish_reason=finish if index == len(pieces) - 1 else 0)
        splitter.apply(chunk)
        content.append(chunk.text)
        counts.append(len(chunk.tool_calls))
        for call in chunk.tool_calls:
            if call.name:
                assert call.index not in calls and call.id.startswith("call_"), "named once, with an id"
                calls[call.index] = [call.name, []]
            calls[call.index][1].append(call.arguments)
    return "".join(content), calls, counts


@pytest.mark.parametrize("parser, text, content, expected", RECORDED)
@pytest.mark.parametrize("size", [1, 3, 7, 10_000])
def test_streamed_calls_reassemble_to_the_parsed_ones(parser, text, content, expected, size) -> None:
    got_content, calls, _ = _stream(parser(), text, size)
    assert got_content == content
    assert [(name, json.loads("".join(pieces))) for name, pieces in calls.values()] == list(expected)


@pytest.mark.parametrize("parser", JSON_LAYOUTS)
def test_json_arguments_stream_while_they_are_written(parser) -> None:
    text = parser().render_calls([TYPES])
    _, calls, counts = _stream(parser(), text, 4)
    assert calls[0][0] == "set" and len([piece for piece in calls[0][1] if piece]) > 10
    assert next(i for i, count in enumerate(counts) if count) * 4 < text.index('"text"')


def test_tagged_calls_go_out_whole_as_each_closes() -> None:
    text = minimax(invoke("get_weather", W_PAIRS), invoke("get_time", T_PAIRS))
    _, calls, counts = _stream(MiniMaxM2Parser(), text, 1)
    assert [pieces for _, pieces in calls.values()] == [[W_JSON], [T_JSON]]  # each in one piece
    assert counts.index(1) == text.index("</invoke>") + len("</invoke>") - 1  # as soon as it closed
    _, calls, counts = _stream(Glm45Parser(), f"{glm('get_weather', W_PAIRS)}\n{glm('get_time', T_PAIRS)}", 1)
    assert sum(counts) == 2 and counts.index(1) == len(glm("get_weather", W_PAIRS)) - 1


def test_a_json_call_cut_after_its_name_streamed_ends_with_its_last_piece() -> None:
    text = DS_BEGIN + ds31("get_weather", W_JSON)[:-25]
    content, calls, _ = _stream(DeepSeekV31Parser(), text, 4, pb.FINISH_REASON_LENGTH)
    assert content == "" and calls[0][0] == "get_weather" and W_JSON.startswith("".join(calls[0][1]))


@pytest.mark.parametrize("name", ["glm45", "minimax_m2", "qwen3_coder", "deepseek_v3", "deepseek_v31", "kimi_k2"])
def test_rendered_calls_parse_back(name) -> None:
    parser = PARSERS[name]()
    calls = [WEATHER, TYPES, TIME]
    parsed = parser.parse(parser.render_calls(calls))
    assert _calls(parsed.calls) == calls and parsed.content == ""
    assert parser.constrained


def test_the_families_layouts_are_the_templates() -> None:
    assert DeepSeekV31Parser().render_calls([TIME]) == DS_BEGIN + ds31("get_time", json.dumps(TIME[1])) + DS_END
    two = "\n".join([ds3("get_time", '{"zone": "CET"}')] * 2)
    assert DeepSeekV3Parser().render_calls([TIME, TIME]) == DS_BEGIN + two + DS_END
    assert KimiK2Parser().render_calls([TIME, TIME]) == K_BEGIN + kimi("functions.get_time:0", '{"zone": "CET"}') \
        + kimi("functions.get_time:1", '{"zone": "CET"}') + K_END
    assert Glm45Parser().render_calls([TIME]) == glm("get_time", T_PAIRS)
    assert MiniMaxM2Parser().render_calls([TIME]) == minimax(invoke("get_time", T_PAIRS))
    assert Qwen3CoderParser().render_calls([TIME]) == qwen("get_time", T_PAIRS)


# Minimal templates holding each family's cue (as the released ones write it).
TEMPLATES = {
    Glm45Parser: "{% if tools %}<tool_call>{name}\n<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>{% endif %}",
    Qwen3CoderParser: "{% if tools %}<tool_call>\n<function=example>\n<parameter=p>\nv\n</parameter>{% endif %}",
    MiniMaxM2Parser: "{%- set begin = '<minimax:tool_call>' -%}{% if tools %}{{ begin }}<invoke name=\"x\">{% endif %}",
    KimiK2Parser: "{% if tools %}{{ tools | tojson }}{% endif %}<|tool_calls_section_begin|><|tool_call_begin|>",
    DeepSeekV31Parser: "{{'" + DS_BEGIN + DS_CALL + "' + tool['function']['name'] + '" + DS_SEP + "'}}",
    DeepSeekV3Parser: "{{'" + DS_CALL + "' + tool['type'] + '" + DS_SEP + "' + name + '\\n```json\\n'}}" + DS_BEGIN,
    HermesParser: "{% if tools %}<tool_call>\n{\"name\": <function-name>}\n</tool_call>{% endif %}",
}


@pytest.mark.parametrize("family, template", TEMPLATES.items())
def test_the_family_is_found_from_its_template_cue(family, template) -> None:
    assert type(detect_tool_parser(template)) is family
    assert type(tool_parser("auto", template)) is family
    assert type(tool_parser(family.name, "{{ '<tool_call>' }}")) is family  # the flag wins
    GatewayConfig(routers=("127.0.0.1:1",), tool_call_parser=family.name)


def test_the_reasoning_block_before_the_calls() -> None:
    # DeepSeek-R1's first template only names </think> (it strips reasoning from history).
    assert detect_reasoning("auto", "{% set content = content.split('</think>')[-1] %}") == "think"
    assert detect_reasoning("auto", TEMPLATES[KimiK2Parser]) is None
    # GLM-4.5 opens its own block; MiniMax-M2's prompt ends inside one.
    outputs = [(False, f"\n<think>The user wants the weather.</think>\n{glm('get_weather', W_PAIRS)}", Glm45Parser),
               (True, f"The user wants the weather.\n</think>\n\n{minimax(invoke('get_weather', W_PAIRS))}",
                MiniMaxM2Parser)]
    for starts_inside, text, parser in outputs:
        for size in (1, 4, 10_000):
            splitter = ChatOutputSplitter(ReasoningSplitter(starts_inside), ToolCallSplitter(parser(), True))
            reasoning, content, calls = "", "", []
            pieces = [text[i:i + size] for i in range(0, len(text), size)]
            for index, piece in enumerate(pieces):
                chunk = pb.GenerateResponse(text=piece, finish_reason=pb.FINISH_REASON_STOP if index == len(pieces) - 1
                                            else 0)
                splitter.apply(chunk)
                reasoning, content = reasoning + chunk.reasoning_text, content + chunk.text
                calls += [(call.name, json.loads(call.arguments)) for call in chunk.tool_calls]
            assert reasoning.strip() == "The user wants the weather." and content == "" and calls == [WEATHER]
            assert chunk.finish_reason == pb.FINISH_REASON_TOOL_CALLS


@pytest.mark.parametrize("name", ["glm45", "minimax_m2", "qwen3_coder", "deepseek_v3", "deepseek_v31", "kimi_k2"])
def test_every_tool_choice_is_constrained(name) -> None:
    """Each layout has its grammar (tests/gateway/test_tool_grammar_layouts.py): auto, required
    and a named function all send one."""
    chat = ChatFormat(PARSERS[name](), True, None)
    tool = pb.Tool(name="get_time", parameters='{"type": "object"}')
    for choice in (pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), pb.ToolChoice(function_name="get_time"),
                   pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_AUTO)):
        request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Time?")], tools=[tool],
                                     tool_choice=choice)
        plan = plan_chat(request, chat, 100_000)
        assert plan.parse_tools and plan.constraint.kind is ConstraintKind.GRAMMAR
        assert plan.constraint.text.startswith("start: " if choice.mode != pb.TOOL_CHOICE_MODE_AUTO else "start: TEXT")


def test_harmony_constrains_a_required_call_and_parses_auto_ones() -> None:
    chat = ChatFormat(PARSERS["harmony"](), True, "harmony")
    tool = pb.Tool(name="get_time", parameters='{"type": "object"}')
    chat_turns = [pb.ChatMessage(role="user", content="Time?")]
    for choice in (pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), pb.ToolChoice(function_name="get_time")):
        plan = plan_chat(pb.GenerateRequest(messages=chat_turns, tools=[tool], tool_choice=choice), chat, 100_000)
        assert plan.parse_tools and "commentary to=functions.get_time " in plan.constraint.text
    auto = plan_chat(pb.GenerateRequest(messages=chat_turns, tools=[tool]), chat, 100_000)
    assert auto.parse_tools and auto.constraint is None
