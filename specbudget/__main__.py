"""`python -m specbudget ...`, the same as the `specbudget` command."""

import sys

from specbudget.cli import main

sys.exit(main())
