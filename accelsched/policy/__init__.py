"""Every decision accelsched makes, as plain code: no distributed import, tested with numbers.

The plugins' parts (``scheduler/``, ``worker/``) ask these modules what to do and act on
the answer; nothing here reads a server, sends a message or keeps a timer.
"""
