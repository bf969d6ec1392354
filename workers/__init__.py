"""The model workers. Importing the package (before anything in it imports torch) makes
OpenMP's idle threads sleep instead of spinning, unless the environment already says how
(`OMP_WAIT_POLICY`): libgomp's spinning threads hold a core while waiting at each of a
step's hundreds of parallel regions, and when the cores are shared (the controller, the
ingress, Ray's daemons, other jobs) every region then waits for a thread that lost its
core. On the 2-core machine under load, LocalEngine with two torch threads ran 5-8x slower
spinning than sleeping (docs/peer.md). libgomp reads the variable once, when torch loads
it: a process that imported torch before this package keeps its own policy."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
