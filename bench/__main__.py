"""`python -m bench`: every benchmark in one command (see bench/suite.py)."""

import sys

from bench.suite import main

sys.exit(main())
