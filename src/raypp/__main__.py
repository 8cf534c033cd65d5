"""``python -m raypp`` is the ``raypp`` command."""

import sys

from raypp.cli import main

sys.exit(main())
