"""``python -m accelsched.cli``: the ``accelsched`` command."""

import sys

from accelsched.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
