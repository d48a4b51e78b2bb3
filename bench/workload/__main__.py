"""`python -m bench.workload`: see bench/workload/__init__.py."""

import sys

from bench.workload.cli import main

sys.exit(main())
