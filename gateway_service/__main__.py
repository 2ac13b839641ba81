"""`python -m gateway_service`: serve GenerationService on --host:--port until SIGINT/SIGTERM.

Once the gateway has stopped (its drain bounded by --shutdown-grace-s), the process exits at
once: the interpreter's own finalization (a garbage collection over the tokenizer's and
libraries' heaps) took seconds past the grace on a busy machine, and there is nothing left
for it to do.
"""

import logging
import os
import sys

from gateway_service.config import PROGRAM
from gateway_service.server import Gateway
from radixserve.serving import run_service


def main() -> None:
    try:
        run_service(PROGRAM, Gateway.start)
    except SystemExit as done:
        if isinstance(done.code, str):  # a one-line reason (SecurityError, bad flags)
            print(done.code, file=sys.stderr)
        status = done.code if isinstance(done.code, int) else 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
