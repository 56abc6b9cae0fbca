"""The scheduler side's parts, wired by :class:`accelsched.PlacementPlugin`.

Nothing here imports the worker side: the two speak through :mod:`accelsched.protocol`.
"""
