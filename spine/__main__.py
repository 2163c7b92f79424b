"""`python -m spine` is the `spine` command."""

import sys

from spine.cli import main

sys.exit(main())
