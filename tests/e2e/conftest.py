"""End-to-end fixtures: transformers' greedy outputs, computed once per session; the agent API's
stack, shared by its test modules (tools, embeddings)."""

from __future__ import annotations

import openai
import pytest

from constrained_model import make_constrained_model
from e2e.agent_model import AGENT_MAX_TOKENS, AGENT_MODEL, AGENT_TIMEOUT_S, write_mean_pooling
from e2e.reference import Reference, greedy_references
from e2e.stack import LaunchedStack, launch
from procs import ServiceProcesses



@pytest.fixture(scope="session")
def references(smollm2_dir) -> list[Reference]:
    return greedy_references(smollm2_dir)


@pytest.fixture(scope="session")
def agent_stack(tmp_path_factory, smollm2_dir) -> LaunchedStack:
    """`radixserve up` (TP=1, HTTP on) over a tiny random Llama with SmolLM2's tokenizer and chat
    template, declaring mean-pooled, normalised embeddings (one stack for the agent tests)."""
    model_dir = make_constrained_model(tmp_path_factory.mktemp("agent") / AGENT_MODEL, smollm2_dir)
    write_mean_pooling(model_dir)
    with ServiceProcesses() as procs:
        yield launch(procs, model_dir, tp=1, default_max_tokens=AGENT_MAX_TOKENS, with_http=True)


@pytest.fixture(scope="session")
def agent_api(agent_stack: LaunchedStack) -> openai.OpenAI:
    """The official openai client on the agent stack's HTTP API."""
    with openai.OpenAI(base_url=f"{agent_stack.http_base}/v1", api_key="unused", max_retries=0,
                       timeout=AGENT_TIMEOUT_S) as client:
        yield client
