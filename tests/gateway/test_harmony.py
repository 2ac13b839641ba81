"""Harmony (gpt-oss) outputs through the chat's output stages: the analysis channel as
reasoning, the final channel and preambles as content, messages to `functions.NAME` as calls,
the same for every way the text arrives in pieces (markers split anywhere), with no marker in
anything reported; outputs cut by max_tokens inside each part; malformed calls never
half-reported; and the format found from the chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from gateway_service import harmony
from gateway_service.chat_output import ChatOutputSplitter, ToolCallSplitter
from gateway_service.config import GatewayConfig
from gateway_service.harmony_splitter import HarmonySplitter
from gateway_service.reasoning import detect_reasoning
from gateway_service.tool_parsers import HarmonyParser, ParsedCall, detect_tool_parser, tool_parser
from radixserve.v1 import generation_pb2 as pb

ANALYSIS = "<|channel|>analysis<|message|>The user asks about Paris. Use get_weather.<|end|>"
THOUGHT = "The user asks about Paris. Use get_weather."
NEXT = "<|start|>assistant"
PARIS = '{"location":"Paris"}'
CALL_AFTER = f"{NEXT}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{PARIS}<|call|>"
CALL_BEFORE = f"{NEXT} to=functions.get_weather<|channel|>commentary json<|message|>{PARIS}<|call|>"
CALL_PLAIN = f"{NEXT}<|channel|>commentary to=functions.get_weather<|message|>{PARIS}"  # no type, EOS left out
TIME = f'{NEXT}<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{{"zone":"CET"}}<|call|>'
WEATHER = ("get_weather", {"location": "Paris"})


@dataclass(frozen=True)
class Case:
    text: str
    reasoning: str
    content: str
    calls: tuple = ()


CASES = {
    "analysis and final": Case(f"{ANALYSIS}{NEXT}<|channel|>final<|message|>It is sunny.<|return|>",
                               THOUGHT, "It is sunny."),
    "final only": Case("<|channel|>final<|message|>Hello!", "", "Hello!"),
    "call, recipient after the channel": Case(ANALYSIS + CALL_AFTER, THOUGHT, "", (WEATHER,)),
    "call, recipient in the header": Case(ANALYSIS + CALL_BEFORE, THOUGHT, "", (WEATHER,)),
    "call without a content type": Case(ANALYSIS + CALL_PLAIN, THOUGHT, "", (WEATHER,)),
    "call as the first message": Case(CALL_BEFORE.removeprefix(NEXT), "", "", (WEATHER,)),
    "several calls": Case(ANALYSIS + CALL_AFTER + TIME, THOUGHT, "", (WEATHER, ("get_time", {"zone": "CET"}))),
    "preamble then call": Case(f"{ANALYSIS}{NEXT}<|channel|>commentary<|message|>Let me check.<|end|>{CALL_AFTER}",
                               THOUGHT, "Let me check.", (WEATHER,)),
    "analysis around a built-in tool": Case(
        f"{ANALYSIS}{NEXT}<|channel|>analysis to=browser.search code<|message|>"
        '{"query":"Paris"}<|call|><|start|>assistant<|channel|>final<|message|>Sunny.',
        THOUGHT + '{"query":"Paris"}', "Sunny."),
    "not harmony at all": Case("Just text, no frame.", "", "Just text, no frame."),
}
# Cut by max_tokens: (output, reasoning, content) whether or not a piece streamed before.
CUT = {
    "mid-analysis": ("<|channel|>analysis<|message|>The user asks ab", "The user asks ab", ""),
    "mid-header": (f"{ANALYSIS}{NEXT}<|channel|>fin", THOUGHT, ""),
    "mid-final": (f"{ANALYSIS}{NEXT}<|channel|>final<|message|>It is su", THOUGHT, "It is su"),
}
CUT_ARGUMENTS = ANALYSIS + f'{NEXT}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{{"loc'
MALFORMED = {
    "not JSON": ANALYSIS + CALL_AFTER.replace(PARIS, "{location: Paris}"),
    "not an object": ANALYSIS + CALL_AFTER.replace(PARIS, "[1, 2]"),
    "no name": ANALYSIS + CALL_AFTER.replace("functions.get_weather", "functions."),
    "second call broken": ANALYSIS + CALL_AFTER + TIME.replace('"CET"}', '"CET"'),
}


@dataclass
class Result:
    reasoning: str
    content: str
    calls: list  # (name, arguments text) per call index
    finish: int


def _splits(text: str) -> list[list[str]]:
    """The text whole, cut in two at every position, and in pieces of a few sizes."""
    splits = [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))]
    return splits + [[text[i:i + size] for i in range(0, len(text), size)] for size in (1, 2, 3, 7)]


def _chat(pieces: list[str], finish: int = pb.FINISH_REASON_STOP, incremental: bool = True,
          parse_calls: bool = True) -> Result:
    """`pieces` as a chat's chunks through the output splitter, the last carrying `finish`."""
    tools = ToolCallSplitter(HarmonyParser(), incremental) if parse_calls else None
    splitter = ChatOutputSplitter(HarmonySplitter(parse_calls), tools)
    reasoning, content, calls, chunk = [], [], {}, None
    for index, piece in enumerate(pieces):
        chunk = pb.GenerateResponse(text=piece, finish_reason=finish if index == len(pieces) - 1 else 0)
        splitter.apply(chunk)
        for reported in (chunk.text, chunk.reasoning_text, *(call.arguments for call in chunk.tool_calls)):
            assert "<|" not in reported, f"markup reported: {reported!r}"
        reasoning.append(chunk.reasoning_text)
        content.append(chunk.text)
        for call in chunk.tool_calls:
            if call.name:
                assert call.index not in calls and call.id.startswith("call_"), "named once, with an id"
                calls[call.index] = [call.name, ""]
            calls[call.index][1] += call.arguments
    return Result("".join(reasoning), "".join(content), [tuple(calls[i]) for i in sorted(calls)], chunk.finish_reason)


def _parsed(calls: list) -> tuple:
    return tuple((name, json.loads(arguments)) for name, arguments in calls)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("incremental", [True, False], ids=["streamed", "whole"])
def test_every_split_gives_the_whole_outputs_answer(name, incremental) -> None:
    case = CASES[name]
    finish = pb.FINISH_REASON_TOOL_CALLS if case.calls else pb.FINISH_REASON_STOP
    for pieces in _splits(case.text):
        got = _chat(pieces, incremental=incremental)
        assert (got.reasoning, got.content, _parsed(got.calls), got.finish) == (
            case.reasoning, case.content, case.calls, finish), pieces


def test_streamed_arguments_are_the_models_own_text_and_start_early() -> None:
    text = ANALYSIS + CALL_AFTER
    splitter = ChatOutputSplitter(HarmonySplitter(True), ToolCallSplitter(HarmonyParser(), incremental=True))
    named_at = None
    for index in range(len(text)):
        chunk = pb.GenerateResponse(text=text[index])
        splitter.apply(chunk)
        if chunk.tool_calls and named_at is None:
            named_at = index
    assert named_at is not None and named_at < text.index(PARIS) + 2  # named once the header is whole
    assert _chat([text]).calls == [("get_weather", PARIS)]


def test_reasoning_streams_before_its_message_ends() -> None:
    splitter = HarmonySplitter(parse_calls=True)
    assert splitter.feed("<|channel|>analysis<|mess").reasoning == ""
    assert splitter.feed("age|>first ").reasoning == "first "
    piece = splitter.feed("second<|e")
    assert piece.reasoning == "second" and piece.content == ""  # "<|e" may be <|end|>: held
    piece = splitter.feed("nd|><|start|>assistant<|channel|>final<|message|>Four.")
    assert piece.reasoning == "" and piece.content == "Four."
    assert splitter.flush().content == ""


@pytest.mark.parametrize("name", CUT)
@pytest.mark.parametrize("incremental", [True, False], ids=["streamed", "whole"])
def test_cut_by_max_tokens_reports_what_it_has(name, incremental) -> None:
    text, reasoning, content = CUT[name]
    for pieces in _splits(text):
        got = _chat(pieces, pb.FINISH_REASON_LENGTH, incremental)
        assert (got.reasoning, got.content, got.calls, got.finish) == (
            reasoning, content, [], pb.FINISH_REASON_LENGTH), pieces


def test_cut_inside_the_arguments_follows_the_families_contract() -> None:
    # Whole: the call does not parse, so its text is content (without the markup).
    got = _chat([CUT_ARGUMENTS], pb.FINISH_REASON_LENGTH, incremental=False)
    assert (got.reasoning, got.content, got.calls, got.finish) == (THOUGHT, '{"loc', [], pb.FINISH_REASON_LENGTH)
    # Streamed after the call was named: its pieces stand, and nothing repeats them as content.
    got = _chat([CUT_ARGUMENTS[:-3], CUT_ARGUMENTS[-3:]], pb.FINISH_REASON_LENGTH)
    assert (got.reasoning, got.content, got.calls, got.finish) == (
        THOUGHT, "", [("get_weather", '{"loc')], pb.FINISH_REASON_LENGTH)


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_calls_are_never_half_reported(name) -> None:
    text = MALFORMED[name]
    got = _chat([text], incremental=False)
    assert got.calls == [] and got.finish == pb.FINISH_REASON_STOP and got.reasoning == THOUGHT
    bodies = HarmonyParser().unparsed_content(text.removeprefix(ANALYSIS))
    assert got.content == bodies and "<|" not in bodies and bodies


def test_calls_without_tools_are_content() -> None:
    got = _chat([ANALYSIS + CALL_AFTER], parse_calls=False)
    assert (got.reasoning, got.content, got.calls, got.finish) == (THOUGHT, PARIS, [], pb.FINISH_REASON_STOP)


def test_the_parser_reads_what_it_renders_and_what_the_splitter_passes_on() -> None:
    parser = HarmonyParser()
    text = parser.render_calls([WEATHER, ("get_time", {"zone": "CET"})])
    assert parser.parse(text).calls == (ParsedCall("get_weather", '{"location": "Paris"}'),
                                        ParsedCall("get_time", '{"zone": "CET"}'))
    # Whatever way the model placed the recipient, the splitter passes on one layout.
    for layout in (CALL_AFTER, CALL_BEFORE):
        passed = HarmonySplitter(parse_calls=True).feed(ANALYSIS + layout).content
        assert passed == harmony.call_header("get_weather") + PARIS + harmony.CALL
    assert parser.parse("Checking." + text + "Done.").content == "Checking.Done."


def test_headers() -> None:
    assert harmony.read_header("<|channel|>commentary to=functions.f <|constrain|>json") == harmony.Header(
        "commentary", "functions.f")
    assert harmony.read_header("assistant to=functions.f<|channel|>commentary json").function == "f"
    assert harmony.read_header("<|channel|>analysis") == harmony.Header("analysis", None)
    assert harmony.read_header("assistant").channel is None
    assert harmony.read_header(" to=browser.search<|channel|>analysis").function is None


GPT_OSS_LIKE = ("{%- for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final"
                "{% endif %}<|message|>{{ m.content }}<|end|>{%- endfor %}"
                "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")


def test_detection_from_the_chat_template() -> None:
    assert detect_reasoning("auto", GPT_OSS_LIKE) == "harmony" and detect_reasoning("auto", "<think>") == "think"
    assert detect_reasoning("harmony", "{{ content }}") == "harmony" and detect_reasoning("none", GPT_OSS_LIKE) is None
    assert isinstance(detect_tool_parser(GPT_OSS_LIKE), HarmonyParser)
    assert isinstance(tool_parser("harmony", "{{ '<tool_call>' }}"), HarmonyParser)
    assert not isinstance(detect_tool_parser("{{ '<tool_call>' }}{% if tools %}{% endif %}"), HarmonyParser)


def test_harmony_is_both_parsers_or_neither() -> None:
    base = dict(routers=("127.0.0.1:1",))
    GatewayConfig(**base, reasoning_parser="harmony", tool_call_parser="auto")
    GatewayConfig(**base, reasoning_parser="harmony", tool_call_parser="harmony")
    for reasoning, tools in (("harmony", "hermes"), ("none", "harmony"), ("think", "harmony")):
        with pytest.raises(ValueError, match="harmony is one format"):
            GatewayConfig(**base, reasoning_parser=reasoning, tool_call_parser=tools)
