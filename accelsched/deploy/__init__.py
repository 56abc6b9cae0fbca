"""Clusters started without a client: ``--preload accelsched`` and fast worker restarts."""
