"""What every benchmark shares: clusters on simulated GPUs, memory sampling, plots, and
the provenance each result file records. Micro-benchmarks and studies import from here,
never from each other."""
