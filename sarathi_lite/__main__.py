"""``python -m sarathi_lite ...`` is the ``sarathi-lite`` command."""

import sys

from sarathi_lite.cli import main

sys.exit(main())
