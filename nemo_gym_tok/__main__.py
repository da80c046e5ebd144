"""`python -m nemo_gym_tok` runs the `ngt` command line."""

import sys

from nemo_gym_tok.cli.main import main

sys.exit(main())
