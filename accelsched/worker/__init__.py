"""The worker side's parts, wired by :class:`accelsched.GuardPlugin`.

Nothing here imports the scheduler side: the two speak through :mod:`accelsched.protocol`.
"""
