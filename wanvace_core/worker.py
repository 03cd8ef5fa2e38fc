"""`python -m wanvace_core.worker`: one rank of the parallel workers (see `wanvace_core.parallel.rank`)."""

import sys

from .parallel.rank import main

if __name__ == "__main__":
    sys.exit(main())
