"""What one more activation row costs the native block kernels, against the first.

    python benchmarks/kernel_rows.py [--rounds 7] [--threads 1]

Lookahead's economics rest on this: a pending token and its drafts are rows of one group, which
reads each dequantized weight block once, so a draft costs only its own multiply-adds. This times
``kernels.matmul`` on random Q4_1 matrices of the embedded model's shapes (576 -> 1536, the MLP's
up and gate; 1536 -> 576, its down projection) for 1 to 12 rows, and prints nanoseconds per weight
block for the first row and for each further row (the best of ``--rounds``, each of 20 calls), and
their ratio: about the share of a one-position step that a draft costs in the layers.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from multistream.text._accel.block_layers import Q4Linear
from multistream.text._accel.kernels import BLOCK, QuantizedMatrix, matmul, native_kernels

ROWS = (1, 2, 4, 8, 12)


def per_call_s(x: torch.Tensor, matrix: QuantizedMatrix, threads: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(20):
            matmul(x, matrix, threads)
        best = min(best, (time.perf_counter() - start) / 20)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    kernels = native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels are not built here (no C compiler?)")
    print(f"{kernels.isa}, row group {kernels.row_group()}, {args.threads} thread(s), load average {os.getloadavg()}")
    print("| matrix | first row ns/block | each further row ns/block (2, 4, 8, 12 rows) | further / first |")
    print("|---|---|---|---|")
    torch.manual_seed(0)
    for n, k in ((1536, 576), (576, 1536)):
        weight, scales = Q4Linear.quantize_weight(torch.randn(n, k))
        matrix = QuantizedMatrix(4, weight, scales)
        blocks = n * k / BLOCK
        seconds = {rows: per_call_s(torch.randn(rows, k), matrix, args.threads, args.rounds) for rows in ROWS}
        first = seconds[1] * 1e9 / blocks
        further = [(seconds[rows] - seconds[1]) * 1e9 / blocks / (rows - 1) for rows in ROWS[1:]]
        print(f"| Q4_1 {k} -> {n} | {first:.2f} | {', '.join(f'{f:.2f}' for f in further)} | "
              f"{min(further) / first:.2f}-{max(further) / first:.2f} |")


if __name__ == "__main__":
    main()
