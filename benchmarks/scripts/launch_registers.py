"""Usage: PYTHONPATH=src python3 benchmarks/scripts/launch_registers.py W14 [--backward] [--sm 90] [knob=value ...]

Registers a thread and programs an SM of an axial workload's launches (W13, W14, W15), without a
GPU. The workload's call runs once on CPU tensors of its shape family (a token count past the
decode size, so the plan is the large-call one) with the kernel launch replaced by a recorder;
each recorded launch is compiled for the target (sm_90 by default) with the specializations
Triton's launcher gives it (16-byte aligned pointers, integers equal to 1 or divisible by 16 unless
the kernel declines to specialize them), and ptxas (Triton's own) reports its registers. Knobs are
ropekit.core.tuning's (`prefetch=0`, `norm_warps=4`, ...), handed to it as its ROPEKIT_<NAME>
environment variables. --backward records the autograd
backward's launches too. Needs a Triton with its NVIDIA backend (any Linux wheel).

Occupancy is what decided W14's prefetch default (benchmarks/PERF_LOG.md, v27): a 2-warp program
of 223 registers leaves four programs an SM, one of 167 six.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile

SHAPES = {  # each workload's shape family with about 2,400 tokens (past decode_tokens)
    "W13": dict(B=1, Txt=64, Hp=48, Wp=48, H=24, D=128),
    "W14": dict(B=1, F=2, Hp=30, Wp=40, H=40, D=128),
    "W15": dict(B=4, Hp=24, H=16, D=64),
}
TYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.int64": "i64"}


def record(workload: str, backward: bool) -> list:
    """[(kernel name, [(kind, value)], meta)] of every launch of the workload's call."""
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the Triton path (never run: recorded)
    import torch

    import ropekit
    from ropekit.core import pipeline, plans
    from ropekit.tools.bench import workloads as W

    launches = []

    def recorder(kernel, compiled, variant, grid, ptrs, args, meta, addrs=None, bits=None):
        values = [("ptr", TYPES[str(p.dtype)]) for p in ptrs]
        for a in args:
            if isinstance(a, torch.Tensor):
                values.append(("ptr", TYPES[str(a.dtype)]))
            else:
                values.append(("float" if isinstance(a, float) else "int", a))
        launches.append((kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, values, dict(meta)))

    plans.launch_kernel = recorder  # the norm's backward
    pipeline.launch = recorder  # the forward runs (rotation, store, re-rotation)
    wl = W.BY_ID[workload]
    inp = W.axial_inputs(wl, SHAPES[workload], W.axial_freqs(wl, "cpu"), "cpu", 0)
    for n in ("q", "k", "wq", "wk"):
        if n in inp:
            inp[n].requires_grad_(backward)
    qo, ko = ropekit.apply_rope(
        inp["q"],
        inp["k"],
        inp["positions"],
        None,
        inv_freq=inp["cache"],
        axes=tuple(d // 2 for d in wl.axes_dim),
        interleaved=wl.interleaved,
        q_norm_weight=inp.get("wq"),
        k_norm_weight=inp.get("wk"),
    )
    if backward:
        torch.autograd.backward((qo, ko), (torch.zeros_like(qo), torch.zeros_like(ko)))
    return launches


def compile_all(launches: list, sm: int) -> None:
    """Compile each recorded launch for sm_<sm> and print its ptxas line and programs an SM."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ropekit.kernels.backward import rope_norm_backward_kernel
    from ropekit.kernels.rope import rope_kernel

    kernels = {k.fn.__name__: k for k in (rope_kernel, rope_norm_backward_kernel)}
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # Triton's wheels carry ptxas, and some a newer one beside it for newer PTX: the first that takes it
    assemblers = [
        os.path.join(bin_dir, n) for n in ("ptxas", "ptxas-blackwell") if os.path.exists(os.path.join(bin_dir, n))
    ]
    for name, values, meta in launches:
        kernel = kernels[name]
        keep = set(getattr(kernel, "do_not_specialize", ()))
        sig, consts, attrs, values = {}, {}, {}, list(values)
        for i, p in enumerate(kernel.params):
            if p.is_constexpr:
                sig[p.name], consts[p.name] = "constexpr", meta[p.name]
                continue
            kind, v = values.pop(0)
            if kind == "ptr":
                sig[p.name], attrs[(i,)] = "*" + v, [["tt.divisibility", 16]]
            elif kind == "float":
                sig[p.name] = "fp32"
            elif p.name not in keep and v == 1:
                sig[p.name], consts[p.name] = "constexpr", 1
            else:
                sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
                if p.name not in keep and v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        warps = meta["num_warps"]
        compiled = triton.compile(
            ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", sm, 32), options={"num_warps": warps}
        )
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(compiled.asm["ptx"])
            f.flush()
            arch = f"sm_{sm}a" if sm >= 90 else f"sm_{sm}"
            errors = []
            for ptxas in assemblers:
                out = subprocess.run(
                    [ptxas, "-v", "--gpu-name", arch, f.name, "-o", os.devnull], capture_output=True, text=True
                )
                line = next((ln.split(":", 1)[1].strip() for ln in out.stderr.splitlines() if "Used" in ln), None)
                if out.returncode == 0 and line:
                    break
                errors.append(f"{ptxas}: {out.stderr.strip()}")
            else:
                sys.exit("launch_registers: no ptxas of this Triton assembled the PTX:\n" + "\n".join(errors))
        regs = int(line.split()[1])  # "Used N registers, ..."
        # 65,536 registers an SM, allocated per thread in multiples of 8; at most 64 warps an SM
        per_program = -(-regs // 8) * 8 * 32 * warps
        programs = min(65536 // per_program, 64 // warps)
        flags = {k: meta[k] for k in ("HEAD_LOOP", "PREFETCH", "WHOLE", "BLOCK_H", "BLOCK_H2", "BLOCK_H3") if k in meta}
        print(f"{name} warps={warps} {flags}: {line}; {programs} programs an SM by registers")


def main() -> None:
    if sys.argv[1:2] == ["--compile"]:  # the child: recorded launches in, no interpreter
        with open(sys.argv[2], "rb") as f:
            compile_all(pickle.load(f), int(sys.argv[3]))
        return
    args = sys.argv[1:]
    if not args or args[0] not in SHAPES:
        sys.exit(__doc__.split("\n\n")[0] + f"\n  workloads: {sorted(SHAPES)}")
    backward, sm = "--backward" in args, 90
    rest = [a for a in args[1:] if a != "--backward"]
    if "--sm" in rest:
        i = rest.index("--sm")
        sm = int(rest[i + 1])
        del rest[i : i + 2]
    for a in rest:  # knobs, as ropekit.core.tuning reads them from the environment
        name, _, value = a.partition("=")
        os.environ[f"ROPEKIT_{name.upper()}"] = value
    launches = record(args[0], backward)
    with tempfile.NamedTemporaryFile("wb", suffix=".pkl", delete=False) as f:
        pickle.dump(launches, f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        subprocess.run([sys.executable, __file__, "--compile", f.name, str(sm)], env=env, check=True)
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    main()
