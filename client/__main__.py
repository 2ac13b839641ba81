"""`python -m client`: see client/cli.py."""

import sys

from client.cli import main

sys.exit(main())
