import sys

from agent.runner import main

sys.exit(main())
