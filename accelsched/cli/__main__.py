"""``python -m accelsched.cli``: the ``accelsched`` command."""

from accelsched.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
