"""Micro-benchmarks: what one mechanism costs or how long it takes (the guard's hot path,
the overhead against plain distributed, a restart, a fallback, how the scheduler's costs
grow). Their figures are the ones a change to that mechanism moves."""
