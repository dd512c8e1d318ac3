#!/usr/bin/python3
"""All-reduce timing loop for scripts/compare-mpi, run under mpirun (Open MPI + mpi4py).

    mpirun --allow-run-as-root -np 2 --bind-to core [--mca pml ucx] \
        /usr/bin/python3 scripts/mpi_allreduce.py --size 8,1048576 --iters 20000,500

For each size: a float32 sum all-reduce of SIZE bytes per rank (SIZE/4 elements, numpy
buffers when numpy is there, else an array.array), WARMUP untimed calls, a barrier, then ITERS
calls each timed on its own with MPI.Wtime. Each rank takes the median (p50) and p99 of its own
samples; rank 0 prints one JSON object per size on stdout with the slowest rank's p50 and p99
(MPI.MAX over ranks), the bus bandwidth from that p50 (size * 2 * (n-1) / n / p50, the
NCCL/MPI convention) and the pml Open MPI selected. The result is checked on every rank
after the loop.
"""

import argparse
import json
import sys

from mpi4py import MPI

try:
    import numpy as np
except ImportError:  # The loop still runs on array.array buffers, a little slower to set up.
    np = None


def buffers(count, rank):
    if np is not None:
        send = np.full(count, float(rank + 1), dtype=np.float32)
        recv = np.zeros(count, dtype=np.float32)
        return send, recv
    import array

    return array.array("f", [float(rank + 1)] * count), array.array("f", [0.0] * count)


def quantile(sorted_samples, q):
    if not sorted_samples:
        return 0.0
    i = min(len(sorted_samples) - 1, int(q * len(sorted_samples)))
    return sorted_samples[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="8,1048576", help="bytes per rank, comma-separated")
    ap.add_argument("--iters", default="20000,500", help="timed calls per size (one, or one per size)")
    ap.add_argument("--warmup", type=int, default=-1, help="untimed calls first (default iters/10, at most 1000)")
    ap.add_argument("--pml", default="default", help="label for the output (the --mca pml given to mpirun)")
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    sizes = [int(s) for s in a.size.split(",") if s]
    iters = [int(s) for s in a.iters.split(",") if s]
    if len(iters) == 1:
        iters = iters * len(sizes)
    if len(iters) != len(sizes):
        if rank == 0:
            print("mpi_allreduce: --iters takes one count or one per size", file=sys.stderr)
        comm.Abort(2)
    for nbytes, n in zip(sizes, iters):
        count = max(1, nbytes // 4)
        send, recv = buffers(count, rank)
        warmup = a.warmup if a.warmup >= 0 else min(n // 10, 1000)
        for _ in range(warmup):
            comm.Allreduce(send, recv, op=MPI.SUM)
        comm.Barrier()
        samples = []
        wtime = MPI.Wtime
        allreduce = comm.Allreduce
        for _ in range(n):
            t0 = wtime()
            allreduce(send, recv, op=MPI.SUM)
            samples.append(wtime() - t0)
        want = size * (size + 1) / 2
        bad = [i for i in (0, count - 1) if recv[i] != want]
        if bad:
            print(f"mpi_allreduce: rank {rank}: element {bad[0]} is {recv[bad[0]]}, not {want}", file=sys.stderr)
            comm.Abort(1)
        samples.sort()
        p50 = comm.allreduce(quantile(samples, 0.5), op=MPI.MAX)
        p99 = comm.allreduce(quantile(samples, 0.99), op=MPI.MAX)
        if rank == 0:
            actual = count * 4
            busbw = actual * 2 * (size - 1) / size / p50 / 1e9 if p50 > 0 else 0.0
            print(
                json.dumps(
                    {
                        "impl": "openmpi",
                        "pml": a.pml,
                        "ranks": size,
                        "size": actual,
                        "iters": n,
                        "p50_us": p50 * 1e6,
                        "p99_us": p99 * 1e6,
                        "busbw_gb_s": busbw,
                        "numpy": np is not None,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
