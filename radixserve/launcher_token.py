"""The internal token `radixserve up` makes for each launch when none is given.

Secure by default: without `--internal-token-file`, the launcher writes a fresh random token into
a private folder (mode 0700, the file 0600) and every child gets that file as its
`--internal-token-file`, so the router and the workers answer any caller that lacks it with
UNAUTHENTICATED, like any local process on the machine. The token itself never appears on a
command line (other users can read those); only the file's path does. The folder is removed when
the launcher ends.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from radixserve.security import SecurityConfig

TOKEN_FILE_NAME = "internal-token"
# 32 random bytes, as URL-safe base64 (43 characters: a valid bearer token).
TOKEN_BYTES = 32
_DIR_MODE = 0o700
_FILE_MODE = 0o600


@contextmanager
def launch_security(config: SecurityConfig) -> Iterator[SecurityConfig]:
    """`config` as given when it names an internal token file; otherwise `config` with a token
    file made for this launch, removed on exit."""
    if config.internal_token_file:
        yield config
        return
    folder = Path(tempfile.mkdtemp(prefix="radixserve-launch-"))
    try:
        os.chmod(folder, _DIR_MODE)
        path = folder / TOKEN_FILE_NAME
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(TOKEN_BYTES) + "\n")
        yield dataclasses.replace(config, internal_token_file=str(path))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
