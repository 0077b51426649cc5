"""python -m serve --model PATH [--host 127.0.0.1] [--port 8000] ... (see serve/cli.py)."""

import sys

from serve.cli import main

sys.exit(main())
