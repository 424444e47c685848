"""`python -m rosejax.serve --model gpt2 --port 8000`."""

import sys

from rosejax.serve.cli import main

sys.exit(main())
