"""`python -m faults`: see faults/__init__.py."""

import sys

from faults.cli import main

sys.exit(main())
