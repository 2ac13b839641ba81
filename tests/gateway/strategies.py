"""Hypothesis strategies for GenerateRequests, mostly malformed (shared with the e2e tests)."""

from __future__ import annotations

from hypothesis import strategies as st

from radixserve.v1 import generation_pb2 as pb

INT32 = st.integers(-(2**31), 2**31 - 1)
floats = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, 1.0, 2.0, -2.0, 0.5]),
)
texts = st.text(max_size=30)
roles = st.sampled_from(["system", "user", "assistant", "tool", "", "User", "x"])


@st.composite
def sampling_params(draw) -> pb.SamplingParams:
    params = pb.SamplingParams()
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        value = draw(floats)
        if value is not None:
            setattr(params, name, value)
    top_k = draw(st.one_of(st.none(), INT32))
    if top_k is not None:
        params.top_k = top_k
    seed = draw(st.one_of(st.none(), st.integers(0, 2**64 - 1)))
    if seed is not None:
        params.seed = seed
    return params


@st.composite
def generate_requests(draw, max_tokens=st.one_of(st.none(), INT32, st.integers(1, 600))) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        prompt=draw(texts),
        messages=[
            pb.ChatMessage(role=role, content=content)
            for role, content in draw(st.lists(st.tuples(roles, texts), max_size=3))
        ],
        stop=draw(st.lists(st.text(max_size=4), max_size=3)),
        stop_token_ids=draw(st.lists(INT32, max_size=3)),
        ignore_eos=draw(st.booleans()),
        sampling=draw(sampling_params()),
        logprobs=draw(st.booleans()),
        top_logprobs=draw(INT32 | st.integers(0, 21)),
        request_id=draw(st.text(max_size=10)),
    )
    value = draw(max_tokens)
    if value is not None:
        request.max_tokens = value
    return request
