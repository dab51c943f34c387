"""`python -m gpu_agent`: the agent's command line (`gpu_agent.runtime.cli`)."""

import sys

from gpu_agent.runtime.cli import main

sys.exit(main())
