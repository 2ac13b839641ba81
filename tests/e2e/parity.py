"""The check shared by the TP=1 and TP=2 stacks: greedy chat output equals transformers'."""

from __future__ import annotations

from radixserve_client import Client
from e2e.reference import CHATS, MAX_NEW_TOKENS, Reference


def check_greedy_parity(address: str, index: int, reference: Reference) -> None:
    with Client(address) as client:
        chunks = list(client.stream(messages=CHATS[index], max_tokens=MAX_NEW_TOKENS, temperature=0,
                                    timeout=120))
    token_ids = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text for c in chunks)
    assert token_ids == reference.output_ids, (text, reference.text)
    assert text == reference.text
    last = chunks[-1]
    assert last.finish_reason == ("stop" if reference.finished_by_eos else "length")
    assert last.usage.prompt_tokens == len(reference.prompt_ids)
    assert last.usage.completion_tokens == len(reference.output_ids)
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
