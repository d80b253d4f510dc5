"""`python -P -m kvrail.cli`: the same as the `kvrail` command."""

import sys

from kvrail.cli.main import main

sys.exit(main())
