"""`python -m models.hf`: see models/hf/cli.py."""

import sys

from models.hf.cli import main

sys.exit(main())
