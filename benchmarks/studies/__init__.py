"""Studies: how accelsched's policies behave on a workload (leak handling against what
users do today, detection against leak size and on benign workloads, attribution of a
leak to its step). Their figures are answers about behaviour, not costs."""
