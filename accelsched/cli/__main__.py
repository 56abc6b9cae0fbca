"""``python -m accelsched.cli``: the ``accelsched`` command."""

from accelsched.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
