import sys

from gpu_agent.runtime.cli import main

sys.exit(main())
