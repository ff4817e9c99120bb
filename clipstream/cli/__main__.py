"""`python -m clipstream.cli`: the `clipstream` command."""

import sys

from clipstream.cli import main

sys.exit(main())
