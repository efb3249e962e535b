"""``python -m pipeline.backends.litert_converter [--force] [--verbose]``: make the converter's environment."""

import sys

from pipeline.backends.litert_converter import main

sys.exit(main(sys.argv[1:]))
