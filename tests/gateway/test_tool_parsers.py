"""Tool-call parsers on outputs written the way each family writes them, well formed and not:
a malformed output comes back whole as content, never as an exception or half the calls; and
the streaming splitter, fed any split of an output, gives the same content and calls as the
whole text."""

from __future__ import annotations

import json

import pytest

from gateway_service.chat_output import ChatOutputSplitter, ToolCallSplitter
from gateway_service.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedCall,
    detect_tool_parser,
    tool_parser,
)
from radixserve.v1 import generation_pb2 as pb

WEATHER = ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ParsedCall("get_time", '{"zone": "CET"}')

# (parser, output, expected content, expected calls)
RECORDED = [
    # Qwen 2.5 / Hermes: one call, two calls, text before, an unclosed last block (EOS after
    # the JSON), arguments given as a JSON string.
    (HermesParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
     '</tool_call>', "", (WEATHER,)),
    (HermesParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "", (WEATHER, TIME)),
    (HermesParser, 'Let me look that up.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}'
     '\n</tool_call>', "Let me look that up.\n", (TIME,)),
    (HermesParser, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}', "", (TIME,)),
    # Cut by max_tokens inside the last closing tag: every call is whole.
    (HermesParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_c', "", (WEATHER, TIME)),
    (HermesParser, '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>', "",
     (TIME,)),
    (HermesParser, "The weather is fine.", "The weather is fine.", ()),
    # Llama 3.1 / 3.2: bare JSON with "parameters", the python tag, several separated by ";".
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "",
     (WEATHER,)),
    (Llama3JsonParser, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', "", (TIME,)),
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "parameters": {"zone": "CET"}}', "", (WEATHER, TIME)),
    (Llama3JsonParser, "It is 12:00 in Paris {approximately}.", "It is 12:00 in Paris {approximately}.", ()),
    # Mistral: the JSON array after [TOOL_CALLS], and the newer name[ARGS]{...} layout.
    (MistralParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}}]', "", (WEATHER, TIME)),
    (MistralParser, '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', "", (TIME,)),
    (MistralParser, 'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]', "Sure.", (TIME,)),
]

MALFORMED = [
    (HermesParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut by max_tokens
    (HermesParser, '<tool_call>\n{"arguments": {"zone": "CET"}}\n</tool_call>'),  # no name
    (HermesParser, '<tool_call>\n{"name": "get_time", "arguments": [1, 2]}\n</tool_call>'),  # not an object
    (HermesParser, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\nnot json'),
    (HermesParser, "<tool_call></tool_call>"),
    (Llama3JsonParser, '{"name": "get_time", "parameters": {"zone": '),
    (Llama3JsonParser, '{"parameters": {}}'),
    (Llama3JsonParser, '{"name": "get_time", "parameters": {}} and then some words'),
    (MistralParser, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}'),
    (MistralParser, '[TOOL_CALLS]{"name": "get_time"}'),
    (MistralParser, "[TOOL_CALLS]get_time{}"),
]


@pytest.mark.parametrize("parser, text, content, calls", RECORDED)
def test_recorded_outputs_parse_into_content_and_calls(parser, text, content, calls) -> None:
    parsed = parser().parse(text)
    assert parsed.content == content
    assert parsed.calls == calls
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("parser, text", MALFORMED)
def test_malformed_outputs_come_back_whole_as_content(parser, text) -> None:
    parsed = parser().parse(text)
    assert parsed.content == text and parsed.calls == ()


def _split_feed(parser, text: str, sizes: int) -> tuple[str, tuple]:
    splitter = ToolCallSplitter(parser)
    pieces = [splitter.feed(text[i:i + sizes]) for i in range(0, len(text), sizes)]
    rest, calls = splitter.finish()
    return "".join(pieces) + rest, calls


@pytest.mark.parametrize("parser, text", [(p, t) for p, t, _, _ in RECORDED] + MALFORMED)
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streaming_any_split_gives_the_whole_texts_answer(parser, text, size) -> None:
    whole = parser().parse(text)
    assert _split_feed(parser(), text, size) == (whole.content, whole.calls)


def test_content_before_a_call_streams_before_the_call_ends() -> None:
    splitter = ToolCallSplitter(HermesParser())
    assert splitter.feed("Checking <tool") == "Checking "  # "<tool" may open the marker: held
    assert splitter.feed("_call>\n{") == ""
    assert splitter.feed('"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>') == ""
    assert splitter.finish() == ("", (TIME,))
    splitter = ToolCallSplitter(HermesParser())
    assert splitter.feed("a <b") == "a <b"  # not the marker's beginning


def test_llama_holds_only_the_start_of_the_output() -> None:
    splitter = ToolCallSplitter(Llama3JsonParser())
    assert splitter.feed("  ") == ""  # blank: a call may still follow
    assert splitter.feed("The answer {x}") == "  The answer {x}"
    assert splitter.finish() == ("", ())


def test_each_family_renders_calls_its_parser_reads() -> None:
    for parser in (HermesParser(), Llama3JsonParser(), MistralParser()):
        text = parser.render_calls([("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})])
        assert parser.parse(text).calls == (WEATHER, TIME), parser.name


def test_the_default_parser_comes_from_the_template() -> None:
    assert isinstance(detect_tool_parser("{{ '<tool_call>' }}{% if tools %}{% endif %}"), HermesParser)
    assert isinstance(detect_tool_parser("{{- '<|python_tag|>' }}{% if tools %}{% endif %}"), Llama3JsonParser)
    assert isinstance(detect_tool_parser("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}"), MistralParser)
    assert isinstance(detect_tool_parser("{{ message['content'] }}"), HermesParser)  # no tools: the fallback
    assert isinstance(tool_parser("mistral", "{{ '<tool_call>' }}"), MistralParser)  # the flag wins


def _incremental_feed(parser, text: str, size: int) -> tuple[str, dict[int, list], list[int]]:
    """Feed `text` in pieces of `size` with incremental calls: (content, per call index its
    name and argument pieces, how many pieces each feed gave)."""
    splitter = ToolCallSplitter(parser, incremental=True)
    content, calls, counts = [], {}, []
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for piece in pieces:
        content.append(splitter.feed(piece))
        deltas = splitter.deltas()
        counts.append(len(deltas))
        for delta in deltas:
            _add_delta(calls, delta)
    rest, parsed = splitter.finish()
    for delta in splitter.final_deltas(parsed):
        _add_delta(calls, delta)
    return "".join(content) + rest, calls, counts


def _add_delta(calls: dict, delta) -> None:
    if delta.name is not None:
        assert delta.index not in calls, "a call is named once, on its first piece"
        calls[delta.index] = [delta.name, []]
    calls[delta.index][1].append(delta.arguments)


@pytest.mark.parametrize("parser, text, content, expected", RECORDED)
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_incremental_pieces_reassemble_to_the_parsed_calls(parser, text, content, expected, size) -> None:
    got_content, calls, _ = _incremental_feed(parser(), text, size)
    assert got_content == content
    assert [(name, json.loads("".join(pieces))) for name, pieces in calls.values()] == [
        (call.name, json.loads(call.arguments)) for call in expected]


def test_arguments_stream_while_they_are_generated() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    _, calls, counts = _incremental_feed(HermesParser(), text, 4)
    assert calls[0][0] == "get_weather"
    assert len([piece for piece in calls[0][1] if piece]) > 5  # many pieces, not one
    first_named = next(i for i, count in enumerate(counts) if count)
    assert first_named * 4 < text.index('"city"')  # the name went out before the arguments were done


def test_a_streamed_call_cut_short_is_not_repeated_as_content() -> None:
    content, calls, _ = _incremental_feed(HermesParser(), MALFORMED[0][1], 5)
    assert content == "" and calls[0][0] == "get_weather"
    assert "".join(calls[0][1]) == '{"city": "Par'


def _stream_chunks(parser, text: str, size: int, finish: int) -> tuple[str, dict[int, list], int]:
    """`text` through `ChatOutputSplitter` as a stream's chunks of `size` characters, the last
    one carrying `finish` (as the gateway applies it to each chunk, the last one included):
    (content, per call index its name and argument pieces, the last chunk's finish reason)."""
    splitter = ChatOutputSplitter(None, ToolCallSplitter(parser, incremental=True))
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    content, calls, chunk = [], {}, None
    for index, piece in enumerate(pieces):
        chunk = pb.GenerateResponse(text=piece, finish_reason=finish if index == len(pieces) - 1 else 0)
        splitter.apply(chunk)
        content.append(chunk.text)
        for call in chunk.tool_calls:
            if call.name:
                assert call.index not in calls and call.id.startswith("call_"), "named once, with an id"
                calls[call.index] = [call.name, []]
            assert call.index in calls, "a piece of a call that was never named"
            calls[call.index][1].append(call.arguments)
    return "".join(content), calls, chunk.finish_reason


@pytest.mark.parametrize("parser, text, content, expected", RECORDED)
@pytest.mark.parametrize("size", [2, 7, 10_000])
def test_a_streams_last_chunk_may_hold_whole_calls(parser, text, content, expected, size) -> None:
    """Coalesced tokens (a consumer behind, accepted drafts) can put a call, or the whole
    output, in the chunk that ends the stream: its calls go out named, whole, once."""
    got_content, calls, finish = _stream_chunks(parser(), text, size, pb.FINISH_REASON_STOP)
    assert got_content == content
    assert [(name, json.loads("".join(pieces))) for name, pieces in calls.values()] == [
        (call.name, json.loads(call.arguments)) for call in expected]
    assert finish == (pb.FINISH_REASON_TOOL_CALLS if expected else pb.FINISH_REASON_STOP)


@pytest.mark.parametrize("parser, text", MALFORMED)
@pytest.mark.parametrize("size", [10_000])
def test_a_call_cut_before_any_piece_streamed_is_content_as_when_not_streamed(parser, text, size) -> None:
    whole = ToolCallSplitter(parser())
    whole.feed(text)
    expected_content, _ = whole.finish()
    assert _stream_chunks(parser(), text, size, pb.FINISH_REASON_LENGTH)[:2] == (expected_content, {})
    assert expected_content == text


def test_a_call_cut_after_its_name_streamed_ends_with_its_last_piece() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "cel'
    content, calls, finish = _stream_chunks(HermesParser(), text, len(text) - 6, pb.FINISH_REASON_LENGTH)
    assert content == "" and finish == pb.FINISH_REASON_LENGTH
    assert calls[0][0] == "get_weather" and "".join(calls[0][1]) == '{"city": "Paris", "unit": "cel'
