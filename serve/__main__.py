"""python -m serve ... : the same server and options as `python -m deepinfer.serve ...`."""

import sys

from deepinfer.serve.cli import main

sys.exit(main())
