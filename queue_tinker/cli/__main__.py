"""`python -m queue_tinker.cli ...`: the same as the `queue-tinker` command."""

import sys

from queue_tinker.cli.main import main

sys.exit(main())
