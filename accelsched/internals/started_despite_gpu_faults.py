"""Imported by the fork server (:mod:`.forkserver`): every worker process forked from it
starts even while its first visible GPU fails NVML (:mod:`.nvml_start`). A module,
because a fork server's preload list names modules to import, nothing else."""

from accelsched.internals.nvml_start import start_despite_failing_gpu

start_despite_failing_gpu()
