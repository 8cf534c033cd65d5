"""``python -m raypp`` is the ``raypp`` command."""

import sys

from raypp.entrypoints.cli import main

sys.exit(main())
