import sys

from accelsched.cli import main

if __name__ == "__main__":
    sys.exit(main())
