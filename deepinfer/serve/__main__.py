"""python -m deepinfer.serve --model PATH [--host 127.0.0.1] [--port 8000] ... (see deepinfer/serve/cli.py)."""

import sys

from deepinfer.serve.cli import main

sys.exit(main())
