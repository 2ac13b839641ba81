"""The checks shared by the stack tests: greedy chat output equals transformers'."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

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


def check_alone_together_and_cached(address: str, references: list[Reference]) -> None:
    """Every chat at transformers' tokens one at a time, then all at once, then the first again
    from the radix cache (some of its prompt cached, not all)."""
    for index, reference in enumerate(references):
        check_greedy_parity(address, index, reference)
    with ThreadPoolExecutor(len(references)) as pool:
        list(pool.map(lambda item: check_greedy_parity(address, *item), enumerate(references)))
    with Client(address) as client:
        again = client.generate(messages=CHATS[0], max_tokens=MAX_NEW_TOKENS, temperature=0, timeout=60)
    assert again.token_ids == references[0].output_ids
    assert 0 < again.usage.cached_tokens < again.usage.prompt_tokens
