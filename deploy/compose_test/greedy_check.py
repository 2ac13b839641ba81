"""A greedy chat through a running gateway, checked token for token against transformers.

    python greedy_check.py [--address HOST:PORT] [--model DIR] [--max-tokens N] [--wait-s S]

`make compose-test` pipes this file into the gateway container (`python - < greedy_check.py`),
where the image has the client, transformers and the model volume; the defaults are that
container's own settings (127.0.0.1:$RADIXSERVE_PORT, $RADIXSERVE_MODEL, and TLS with its
$RADIXSERVE_TLS_CA and the first token of $RADIXSERVE_API_TOKEN_FILE when set). It asks the gateway
to tokenize the chat, generates with temperature 0, runs `generate(do_sample=False)` on the
same prompt ids and prints one JSON line with both. Exit 0 when they agree, 1 when not.
While the gateway answers UNAVAILABLE (a TP group still forming) it retries for `--wait-s`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
DEFAULT_MAX_TOKENS = 16
DEFAULT_WAIT_S = 120.0
CALL_TIMEOUT_S = 120.0
RETRY_INTERVAL_S = 2.0


def served(address: str, max_tokens: int, wait_s: float) -> tuple[list[int], list[int], str]:
    """(prompt ids, generated ids, text) from the gateway, retrying while it is unavailable."""
    from radixserve_client import Client
    from radixserve_client.errors import UnavailableError

    from radixserve.security import read_tokens

    token_file = os.environ.get("RADIXSERVE_API_TOKEN_FILE")
    token = read_tokens(token_file)[0] if token_file else None
    deadline = time.monotonic() + wait_s
    with Client(address, tls_ca=os.environ.get("RADIXSERVE_TLS_CA") or None, api_token=token) as client:
        while True:
            try:
                prompt_ids = client.tokenize(messages=CHAT, timeout=CALL_TIMEOUT_S)
                result = client.generate(messages=CHAT, max_tokens=max_tokens, temperature=0,
                                         timeout=CALL_TIMEOUT_S)
                return prompt_ids, result.token_ids, result.text
            except UnavailableError as exc:
                if time.monotonic() > deadline:
                    raise SystemExit(f"greedy check: {address} still unavailable: {exc}")
                time.sleep(RETRY_INTERVAL_S)


def reference(model_dir: str, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    """transformers' greedy continuation of `prompt_ids` and its text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                             max_new_tokens=max_tokens)
    output_ids = out[0, len(prompt_ids):].tolist()
    return output_ids, tokenizer.decode(output_ids, skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    port = os.environ.get("RADIXSERVE_PORT", "50051")
    parser.add_argument("--address", default=f"127.0.0.1:{port}",
                        help="the gateway (default: %(default)s)")
    parser.add_argument("--model", default=os.environ.get("RADIXSERVE_MODEL"),
                        help="the model folder the gateway serves (default: $RADIXSERVE_MODEL)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--wait-s", type=float, default=DEFAULT_WAIT_S,
                        help="how long to retry while the gateway is unavailable")
    args = parser.parse_args(argv)
    if not args.model:
        parser.error("give --model or set RADIXSERVE_MODEL")
    prompt_ids, token_ids, text = served(args.address, args.max_tokens, args.wait_s)
    reference_ids, reference_text = reference(args.model, prompt_ids, args.max_tokens)
    ok = token_ids == reference_ids and text == reference_text
    print(json.dumps({"ok": ok, "chat": CHAT, "text": text, "token_ids": token_ids,
                      "reference_text": reference_text, "reference_ids": reference_ids}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
