"""``python -m ringlet.distributed.checkpoint``: list, verify and convert checkpoints."""

import sys

from ringlet.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
