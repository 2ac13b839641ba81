"""`python -m radixserve_client`: see radixserve_client/cli.py."""

import sys

from radixserve_client.cli import main

sys.exit(main())
