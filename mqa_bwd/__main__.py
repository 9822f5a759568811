"""``python -m mqa_bwd``: the same command line as the ``mqa-bwd`` console script."""

import sys

from .cli import main

sys.exit(main())
