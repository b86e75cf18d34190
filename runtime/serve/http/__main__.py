"""`python -m runtime.serve.http`: the OpenAI-compatible HTTP server (see runtime.serve.http.server)."""

import sys

from runtime.serve.http.server import main

sys.exit(main())
