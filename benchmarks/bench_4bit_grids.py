"""Which 4-bit grid keeps real pseudo-gradients best: int4Block (uniform) or E3M0 (log)?

Streaming DiLoCo (arXiv 2501.18512) sends pseudo-gradients as E3M0: a sign and
a 3-bit exponent, i.e. 0 and ±max·2^-k (k = 0..6) of a block's max. int4Block
sends a uniform grid, -7..7 steps of max / 7. Both cost 4 bits a value plus one
float32 scale a block. This takes real pseudo-gradients of the tiny GPT-2 (the
bench_compression setup: H AdamW steps, warm-up, from the parameters one round
of the same already moved), packs them both ways, and prints the relative error
and cosine of each, with E3M0's error as a ratio of int4Block's (the baseline).
int4Block goes through the shipped codec (`protocol.encode` / `decode`); E3M0
is written out here, as a reference grid.

    python benchmarks/bench_4bit_grids.py [--inner-steps 20] [--blocks 256 64] [--smoke]

Ends with `ratio_e3m0_vs_int4block=<x>`: E3M0's relative error over int4Block's
at the last block size.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax

from pcp_tui import protocol
from pcp_tui.config import RunConfig
from pcp_tui.testing import parse_with_smoke
from pcp_tui.training.build import build_workload
from pcp_tui.training.shards import sample_batches


def pseudo_gradient(args: argparse.Namespace) -> np.ndarray:
    """Δ = θ − θ_H of a second round of H inner AdamW steps, all tensors flattened together."""
    config = RunConfig(seq_len=64, batch_size=8, data_max_bytes=2**20, platforms=("cpu",))
    workload = build_workload(config, shards=2)
    schedule = optax.warmup_constant_schedule(0.0, 2e-3, 10)
    inner = optax.adamw(schedule, weight_decay=0.1)

    @jax.jit
    def step(params, state, batch):
        grads = jax.grad(workload.loss_fn)(params, batch)
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = {name: jax.numpy.asarray(value) for name, value in workload.params.items()}
    for round_ in range(2):
        start, state = params, inner.init(params)
        batches = sample_batches(
            workload.shards[0],
            steps=args.inner_steps,
            batch_size=8,
            seq_len=64,
            seed=0,
            stream=(round_,),
        )
        for batch in batches:
            params, state = step(params, state, batch)
    return np.concatenate([np.asarray(start[n] - params[n]).reshape(-1) for n in sorted(params)])


def int4_block(values: np.ndarray, block_size: int) -> np.ndarray:
    body = protocol.RoundResult()
    buffers = protocol.encode(body, {"d": values}, quantization="int4Block", block_size=block_size)
    return protocol.decode(b"".join(bytes(b) for b in buffers)).tensors["d"]


def e3m0(values: np.ndarray, block_size: int) -> np.ndarray:
    """Each value as the nearest of 0 and ±2^-k (k = 0..6) times its block's max|x|."""
    padded = np.zeros(-(-values.size // block_size) * block_size, np.float64)
    padded[: values.size] = values
    blocks = padded.reshape(-1, block_size)
    peak = np.abs(blocks).max(axis=1, keepdims=True)
    ratio = np.abs(blocks) / np.where(peak > 0, peak, 1)
    levels = np.array([0.0, *(2.0**-k for k in range(7))])
    nearest = levels[np.abs(ratio[..., None] - levels).argmin(axis=-1)]
    return (np.sign(blocks) * nearest * peak).reshape(-1)[: values.size]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--blocks", type=int, nargs="+", default=[256, 64])
    args = parse_with_smoke(parser, inner_steps=2, blocks=[64])
    delta = pseudo_gradient(args)
    exact = delta.astype(np.float64)
    kurtosis = ((exact - exact.mean()) ** 4).mean() / exact.var() ** 2
    print(f"\n4-bit grids on {delta.size:,} pseudo-gradient values (kurtosis {kurtosis:.1f})")
    print(f"{'grid':<11}{'block':>7}{'relative MSE':>14}{'cosine':>9}{'error vs int4Block':>20}")
    for block_size in args.blocks:
        errors = {}
        for name, grid in (("int4Block", int4_block), ("E3M0", e3m0)):
            decoded = grid(delta, block_size).astype(np.float64)
            errors[name] = ((decoded - exact) ** 2).sum() / (exact**2).sum()
            cosine = decoded @ exact / np.linalg.norm(decoded) / np.linalg.norm(exact)
            print(
                f"{name:<11}{block_size:>7}{errors[name]:>14.4f}{cosine:>9.4f}"
                f"{errors[name] / errors['int4Block']:>20.2f}"
            )
    print(f"ratio_e3m0_vs_int4block={errors['E3M0'] / errors['int4Block']:.3f}")


if __name__ == "__main__":
    main()
