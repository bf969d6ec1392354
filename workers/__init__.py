"""The model workers. Importing the package (before anything in it imports torch) bounds how
long OpenMP's idle threads spin before they sleep, unless the environment already says how
(`GOMP_SPINCOUNT` or `OMP_WAIT_POLICY`).

Why bounded: a step is hundreds of parallel regions a few microseconds apart. Threads that
sleep at once (`OMP_WAIT_POLICY=PASSIVE`) pay a futex wake-up at every region: on the 2-core
machine LocalEngine's offline run went 1.3x faster with a short spin (`SPIN_COUNT`, about
0.2 ms in libgomp's own estimate of 100,000 spins a millisecond), interleaved runs 730 vs 960
tok/s on builtin:bench, and the served scene's long prompt and users gained too. Threads
that spin without bound (libgomp's default of ~3 ms, or `ACTIVE`) hold a core the
controller, the ingress and Ray's daemons need, and every region then waits for a thread
that lost its core: 5-8x slower under load (docs/peer.md). A bounded spin covers the gaps
inside a step and sleeps between steps. libgomp reads the variables once, when torch loads
it: a process that imported torch before this package keeps its own settings."""

import os

# Spins (libgomp's `cpu_relax` loop) before an idle OpenMP thread sleeps; see above.
SPIN_COUNT = 20_000

if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
