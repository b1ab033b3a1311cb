"""``python -m muonscale`` = the ``muonscale`` command."""

import sys

from muonscale.cli import main

sys.exit(main())
