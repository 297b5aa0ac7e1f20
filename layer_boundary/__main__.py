"""``python -m layer_boundary``: the engine's command line (``layer-boundary``)."""

import sys

from .engine.cli import main

sys.exit(main())
