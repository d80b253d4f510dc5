"""`python -P -m kvrail.agent`: see `kvrail.agent.vllm`."""

import sys

from kvrail.agent.vllm import main

sys.exit(main(sys.argv[1:]))
