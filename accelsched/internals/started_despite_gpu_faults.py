"""Imported by the fork server (:mod:`.forkserver`): every worker process forked from it
starts even while its first visible GPU fails NVML
(:func:`.forkserver.start_despite_failing_gpu`). A module, because a fork server's preload
list names modules to import, nothing else."""

from accelsched.internals.forkserver import start_despite_failing_gpu

start_despite_failing_gpu()
