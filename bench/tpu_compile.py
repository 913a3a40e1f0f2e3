"""Every Pallas TPU kernel and its XLA counterpart compiled for TPU generations on this machine.

    python -m bench.tpu_compile [--generations v5e v5p v6e tpu7x] [--shapes 96x8192 32x8192 12x65536 4x65536]
                                [--xla-shapes 32x8192] [--decode-heads 96 32] [--out bench/tpu_compile.json]

Needs the ``tpu`` extra (libtpu). For each generation it takes one compile-only device
(`k3jax.tpu.compile_target`) and compiles, at K3's and Kimi Linear's shapes (head dim 128, chunk 64,
batch 1; ``--shapes`` HEADSxTOKENS on the device: K3's 96 and Kimi Linear's 32 heads at 8K tokens,
and at 64K their 12 and 4 heads of a tensor=8 mesh -- all 96 heads of 64K tokens are 12 GiB of
inputs and 6 GiB of saved chunk states, more than a v5e or v6e holds):

    kda forward        `k3jax.ops.kda.kda`, implementation "pallas" (Mosaic), and "chunk" (XLA) at
                       ``--xla-shapes`` (by default tokamax's anchor shape, 32 heads x 8K tokens)
    kda forward+vjp    the same with the VJP of every input, o's cotangent given
    kda decode pool    `decode_pool.kda_pool_step` of 64 sessions in a pool of 64 rows (``--decode-heads``), both kinds
    conv decode pool   `decode_pool.conv_pool_step` of the same sessions over the q/k/v channels
    mxfp4 matmul       `mxfp4_pallas.pallas_grouped_matmul` (and its transposed form) over 14 experts
                       of K3's latent MoE (3584 -> 3072; 896 experts on 64 devices), 4096 rows

and prints one row per program: compiled or the compiler's refusal (first line), compile seconds,
the VMEM each Mosaic kernel uses (`k3jax.tpu.kernel_vmem_bytes`, the compiler's figure) against the
core's, the device's bytes (arguments + outputs + temporaries), the matmul FLOPs of the traced
program (`k3jax.tpu.matmul_flops`: scans times their length, Pallas kernels times their grid -- the
same count for both forms) beside the compiler's own FLOPs (which see no kernel and count a loop
body once), the compiler's bytes accessed (a Pallas kernel's operands and results; an XLA loop's
body once, so a lower bound for the XLA form), and the roofline time max(matmul FLOPs / peak,
bytes / bandwidth) (`k3jax.tpu.roofline_seconds`). Both KDA forms run their products at fp32
HIGHEST precision, several bf16 MXU passes each on a TPU, so the bf16-peak roofline is a lower
bound for their compute-bound parts. Writes the rows as JSON (atomically).
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from bench.common import table, write_json
from k3jax.ops.kda import kda
from k3jax.ops.kda.decode_pool import conv_pool_step, kda_pool_step
from k3jax.ops.kda.pallas import forced_kernels
from k3jax.ops.mxfp4_pallas import pallas_grouped_matmul
from k3jax.tpu import TargetError, compile_target, kernel_vmem_bytes, matmul_flops, program_cost, roofline_seconds

HEAD_DIM, CHUNK, SESSIONS = 128, 64, 64
MXFP4_EXPERTS, MXFP4_IN, MXFP4_OUT, MXFP4_ROWS = 14, 3584, 3072, 4096
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}


def traced_flops(fn, *args) -> float:
    """`k3jax.tpu.matmul_flops` of ``fn`` traced with the TPU kernels (no per-platform branches)."""
    with forced_kernels("tpu", interpret=False):
        return matmul_flops(jax.make_jaxpr(fn)(*args))


def kda_cases(heads: int, length: int, kinds=("pallas", "xla")):
    """``(name, kind, fn, argument shapes)`` of the KDA sequence programs at one shape, for each of
    ``kinds`` ("pallas": the Mosaic kernels, "xla": the chunk form)."""
    token = (1, length, heads, HEAD_DIM)
    shapes = [(token, jnp.bfloat16)] * 3 + [(token, jnp.float32), ((1, length, heads), jnp.float32)]
    for kind, implementation in (("pallas", "pallas"), ("xla", "chunk")):
        if kind not in kinds:
            continue
        def forward(q, k, v, g, beta, implementation=implementation):
            return kda(q, k, v, g, beta, implementation=implementation, chunk_size=CHUNK)[0]

        def forward_vjp(q, k, v, g, beta, d_o, forward=forward):
            o, pullback = jax.vjp(forward, q, k, v, g, beta)
            return o, pullback(d_o)

        yield f"kda forward H{heads} T{length}", kind, forward, shapes
        yield f"kda forward+vjp H{heads} T{length}", kind, forward_vjp, shapes + [(token, jnp.bfloat16)]


def decode_cases(heads: int):
    """The pooled one-token decode programs (KDA state update, short convolution) for ``heads``."""
    channels = 3 * heads * HEAD_DIM
    state = [((SESSIONS, heads, HEAD_DIM, HEAD_DIM), jnp.float32), ((SESSIONS,), jnp.int32),
             ((SESSIONS, heads, HEAD_DIM), jnp.bfloat16), ((SESSIONS, heads, HEAD_DIM), jnp.bfloat16),
             ((SESSIONS, heads, HEAD_DIM), jnp.bfloat16), ((SESSIONS, heads, HEAD_DIM), jnp.float32),
             ((SESSIONS, heads), jnp.float32)]
    conv = [((SESSIONS, 3, channels), jnp.bfloat16), ((SESSIONS,), jnp.int32), ((SESSIONS, channels), jnp.bfloat16),
            ((channels, 4), jnp.float32)]
    for kind, implementation in (("pallas", "pallas"), ("xla", "chunk")):
        yield (f"kda decode pool H{heads} x{SESSIONS}", kind,
               lambda *a, i=implementation: kda_pool_step(*a, implementation=i), state)
        yield (f"conv decode pool C{channels} x{SESSIONS}", kind,
               lambda *a, i=implementation: conv_pool_step(*a, implementation=i), conv)


def mxfp4_cases():
    """K3's routed-expert products over MXFP4 codes (Pallas only: the XLA form is `k3jax.ops.mxfp4`)."""
    codes = [((MXFP4_EXPERTS, MXFP4_OUT, MXFP4_IN // 2), jnp.uint8), ((MXFP4_EXPERTS, MXFP4_OUT, MXFP4_IN // 32), jnp.uint8),
             ((MXFP4_EXPERTS,), jnp.int32)]
    yield ("mxfp4 matmul", "pallas", lambda x, c, s, n: pallas_grouped_matmul(x, c, s, n),
           [((MXFP4_ROWS, MXFP4_IN), jnp.bfloat16), *codes])
    yield ("mxfp4 matmul transposed", "pallas",
           lambda dy, c, s, n: pallas_grouped_matmul(dy, c, s, n, contract_output=True),
           [((MXFP4_ROWS, MXFP4_OUT), jnp.bfloat16), *codes])


def compile_case(fn, shapes, device, target) -> dict:
    """Compile ``fn`` on abstract arguments placed on ``device`` and read what the compiler says."""
    sharding = NamedSharding(jax.sharding.Mesh(np.array([device]), ("one",)), P())
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
    started = time.perf_counter()
    try:
        compiled = jax.jit(fn).lower(*args).compile()
    except Exception as error:  # noqa: BLE001 -- the compiler's refusal is the measurement
        return {"compiled": False, "error": str(error).strip().splitlines()[0][:300],
                "seconds": time.perf_counter() - started}
    seconds = time.perf_counter() - started
    cost = program_cost(compiled)
    flops = traced_flops(fn, *args)
    return {"compiled": True, "seconds": seconds, "vmem": kernel_vmem_bytes(compiled),
            "device_bytes": cost.arguments + cost.outputs - cost.aliased + cost.temporaries,
            "temporaries": cost.temporaries, "compiler_flops": cost.flops, "matmul_flops": flops,
            "bytes_accessed": cost.bytes_accessed, "roofline_seconds": roofline_seconds(flops, cost.bytes_accessed, target)}


def shape(text: str) -> tuple[int, int]:
    """``HEADSxTOKENS`` -> (heads, tokens)."""
    try:
        heads, tokens = map(int, text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HEADSxTOKENS, e.g. 96x8192, got {text!r}") from None
    return heads, tokens


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.tpu_compile", description=__doc__.split("\n")[0])
    parser.add_argument("--generations", nargs="+", default=["v5e", "v5p", "v6e", "tpu7x"], choices=sorted(TOPOLOGIES))
    parser.add_argument("--shapes", nargs="+", type=shape, default=[(96, 8192), (32, 8192), (12, 65536), (4, 65536)],
                        help="KDA heads x tokens on one device")
    parser.add_argument("--xla-shapes", nargs="+", type=shape, default=[(32, 8192)],
                        help="the shapes of --shapes at which the XLA chunk form is compiled too (its "
                             "forward+VJP takes the TPU compiler minutes on 2 cores)")
    parser.add_argument("--decode-heads", nargs="+", type=int, default=[96, 32], help="KDA heads of the decode pools")
    parser.add_argument("--out", default="bench/tpu_compile.json")
    args = parser.parse_args(argv)
    unknown = [f"{h}x{t}" for h, t in args.xla_shapes if (h, t) not in args.shapes]
    if unknown:
        parser.error(f"--xla-shapes {' '.join(unknown)} not among --shapes")
    return args


def row(generation: str, name: str, kind: str, result: dict, target) -> list:
    if not result["compiled"]:
        return [generation, name, kind, "REFUSED", f"{result['seconds']:.1f}", result["error"][:60], "", "", "", "", ""]
    vmem = "/".join(f"{v / 2**20:.2f}" for v in result["vmem"]) or "-"
    return [generation, name, kind, "ok", f"{result['seconds']:.1f}",
            f"{vmem} of {target.chip.vmem_bytes / 2**20:.0f}", f"{result['device_bytes'] / 2**20:,.0f}",
            f"{result['matmul_flops'] / 1e9:,.1f}", f"{result['compiler_flops'] / 1e9:,.1f}",
            f"{result['bytes_accessed'] / 2**20:,.0f}",
            f"{result['roofline_seconds'] * 1e3:.3f}"]


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    jax.config.update("jax_platforms", "cpu")
    cases = [case for heads, length in args.shapes
             for case in kda_cases(heads, length, ("pallas", "xla") if (heads, length) in args.xla_shapes else ("pallas",))]
    cases += [case for heads in args.decode_heads for case in decode_cases(heads)] + list(mxfp4_cases())
    records, rows = [], []
    for generation in args.generations:
        try:
            target = compile_target(TOPOLOGIES[generation])
        except TargetError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        for name, kind, fn, shapes in cases:
            result = compile_case(fn, shapes, target.devices[0], target)
            records.append({"generation": generation, "program": name, "kind": kind, **result})
            rows.append(row(generation, name, kind, result, target))
            print(" | ".join(map(str, rows[-1])), flush=True)
    print(table(["TPU", "program", "kind", "compiled", "compile s", "VMEM MiB (each kernel) of the core's",
                 "device MiB", "matmul GFLOP",
                 "compiler GFLOP", "MiB accessed", "roofline ms"], rows, left=4))
    path = write_json(args.out, {"jax": jax.__version__, "rows": records})
    print(f"wrote {path}")
    return 0 if all(record["compiled"] for record in records) else 1


if __name__ == "__main__":
    sys.exit(main())
