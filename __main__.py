"""``python -m geir``: the ``geir`` command line."""

from __future__ import annotations

import sys

from .tools.cli import main

sys.exit(main())
