#!/usr/bin/env python3
"""Usage: python3 benchmarks/scripts/same_code.py BASE_REV [--keep DIR]

Do the usual variants of ropekit's kernels compile to the same code as at BASE_REV? A new kernel
flag is meant to leave the common variants' generated code unchanged (its branches are constexpr),
and performance is measured against previous runs. This script compiles a fixed set of usual
calls (rope_kernel plain / in place / interleaved / inverse / normed, with and without the head
loop, full and partial rotary; its norm backward, per head and across heads; the fused store;
re-rotation) for sm_90 from this tree's src/ and from BASE_REV's (git archive), without a GPU
(Triton's NVIDIA backend compiles for a given target), and compares the PTX instruction for
instruction: source line info and debug labels are dropped first (they move with any edit).
Exit status 0 when every program is the same.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _programs(src: Path, out: Path) -> None:
    """Compile the calls with the ropekit under src (a process of its own) into one .ptx per program in out."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, __file__, "--child", str(src), str(out)], check=True, env=env)


def _child(src: Path, out: Path) -> None:
    sys.path.insert(0, str(src))
    import ropekit

    if not Path(ropekit.__file__).resolve().is_relative_to(src.resolve()):
        sys.exit(f"same_code: imported {ropekit.__file__}, not the tree under {src}")
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ropekit.core import tuning

    try:  # the one-call-path core
        from ropekit.core import plans as launcher
        from ropekit.core.run import StoreOperands
        from ropekit.core.variant import Variant
    except ImportError:  # a base revision before it
        from ropekit.core import launcher
        from ropekit.core.pipeline import Variant

        StoreOperands = None
    from ropekit.kernels.rerotate import rerotate_kernel
    from ropekit.kernels.rope import rope_kernel

    try:  # the backward in its own file
        from ropekit.kernels.backward import rope_norm_backward_kernel
    except ImportError:  # a base revision before it
        from ropekit.kernels.rope import rope_norm_backward_kernel
    from ropekit.kernels.store import rope_store_kernel

    types = {torch.float32: "fp32", torch.int64: "i64"}

    def kind(a):
        if isinstance(a, torch.Tensor):
            return "*" + types[a.dtype]
        if isinstance(a, float):
            return "fp32"
        return "i32" if -(2**31) <= a < 2**31 else "i64"

    def compile_one(kernel, ptrs, args, meta, name):
        values, sig, consts = [*ptrs, *args], {}, {}
        for p in kernel.params:
            if p.is_constexpr:
                sig[p.name], consts[p.name] = "constexpr", meta[p.name]
                continue
            v = values.pop(0)
            if type(v) is int and v == 1 and not p.do_not_specialize:
                # Triton's launcher specializes an int argument equal to 1 into a constexpr
                sig[p.name], consts[p.name] = "constexpr", 1
            else:
                sig[p.name] = kind(v)
        compiled = triton.compile(
            ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": meta["num_warps"]}
        )
        (out / f"{name}.ptx").write_text(compiled.asm["ptx"])

    T, H, HK, D = 64, 8, 2, 128
    pos = torch.arange(T)
    for rot in (D, D // 2):
        tab = torch.zeros(4096, rot)
        q, k = torch.zeros(T, H, D), torch.zeros(T, HK, D)
        forms = {
            "plain": Variant(),
            "inplace": Variant(),
            "interleaved": Variant(True, True),
            "inverse": Variant(inverse=True),
            "norm": Variant(norm_q=1, norm_k=2),
        }
        for name, v in forms.items():
            for head_loop in (False, True):
                with tuning.override(head_loop=head_loop):
                    qo, ko = (q, k) if name == "inplace" else (torch.empty_like(q), torch.empty_like(k))
                    plan = launcher.plan_rotate(q, k, qo, ko, launcher.angle_layout(v, rot, pos, tab, None), v)
                    args = plan.args + ((torch.ones(D), torch.ones(HK * D), 1e-6, 0.0) if v.normed else ())
                    ptrs = (q, k, qo, ko, pos, tab, tab, tab, tab)
                    compile_one(rope_kernel, ptrs, args, plan.meta, f"rope_{name}_{rot}_loop{int(head_loop)}")
        # the norm's backward per head and across heads, with the knob's default and with a token's
        # heads walked in blocks (whole_heads off: the across-heads pre-pass)
        for mode, whole in ((1, None), (2, None), (2, False)):
            v, w, gx = Variant(norm_q=mode), torch.ones(D if mode == 1 else H * D), torch.empty_like(q)
            knobs = {} if whole is None else {"whole_heads": whole}
            with tuning.override(**knobs):
                angles = launcher.angle_layout(v, rot, pos, tab, None)
                plan = launcher.plan_norm_backward(q, q, gx, w, angles, v, mode)
            dw = torch.empty(launcher.norm_backward_rows(plan))
            ptrs = (q, q, gx, w, dw, pos, tab, tab)
            name = f"norm_bwd_{mode}_{rot}" + ("" if whole is None else "_blocks")
            compile_one(rope_norm_backward_kernel, ptrs, (*plan.args, 1e-6, 0.0), plan.meta, name)
        caches = torch.empty(16, 16, HK, D), torch.empty(16, 16, HK, D)
        if StoreOperands is not None:
            t = StoreOperands(q, k, k, pos, tab, *caches, pos)
            plan = launcher.plan_store(t, Variant(), rot)
            ptrs = (
                q,
                k,
                k,
                pos,
                tab,
                pos,
                *caches,
                tab,
                tab,
                q,
                tab,
                tab,
                tab,
                tab,
                tab,
            )  # pipeline.run_store's pointers
            if "kcs_ptr" in [p.name for p in rope_store_kernel.params]:
                ptrs += (tab, tab)  # NVFP4's block scales (unread here)
            meta = plan.meta
        else:
            plan = launcher.plan_store(
                q, k, k, pos, tab, *caches, pos, Variant(), rot, False, False, None, False, False, (1, 0)
            )
            meta, ptrs = launcher.store_inputs(plan.meta, q, k, k, pos, tab, *caches, pos, None, None)
        compile_one(rope_store_kernel, ptrs, (*plan.args, 0.0, 0.0), meta, f"store_{rot}")
        rerotate = (caches[0], pos, None, tab, None, Variant(angles="delta"), rot)
        plan = launcher.plan_rerotate(*rerotate) if StoreOperands else launcher.plan_rerotate(*rerotate, False)
        ptrs = (caches[0], pos, pos, pos, tab, tab, pos, tab)
        compile_one(rerotate_kernel, ptrs, (3, *plan.args), plan.meta, f"rerotate_{rot}")
        # M-RoPE (W4's Qwen2-VL chunks, Qwen3-VL's interleaving): (3, T) positions, sections per row
        pos3 = torch.arange(3 * T).view(3, T)
        half = rot // 2
        sections = (half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8)
        for mode in (1, 2):
            v = Variant(mrope=mode, sections=sections)
            for head_loop in (False, True):
                with tuning.override(head_loop=head_loop):
                    qo, ko = torch.empty_like(q), torch.empty_like(k)
                    plan = launcher.plan_rotate(q, k, qo, ko, launcher.angle_layout(v, rot, pos3, tab, None), v)
                    ptrs = (q, k, qo, ko, pos3, tab, tab, tab, tab)
                    compile_one(rope_kernel, ptrs, plan.args, plan.meta, f"rope_mrope{mode}_{rot}_loop{int(head_loop)}")


def _instructions(ptx: str) -> str:
    """PTX without source line info, debug labels, comments and debug sections."""
    kept = []
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section") and ".debug" in line:
            break
        if re.match(r"\s*\.(loc|file)\b", line) or re.match(r"\$L__tmp\d+:", line):
            continue
        kept.append(re.sub(r"//.*$", "", line).rstrip())
    return "\n".join(kept)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="a git revision of this repository (e.g. main)")
    p.add_argument("--keep", default=None, help="write both trees' PTX under this directory")
    a = p.parse_args()
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="ropekit-same-code-"))
    base_src = work / "base"
    base_src.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.base, "src"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(base_src)], input=archive.stdout, check=True)
    trees = {"base": base_src / "src", "this": ROOT / "src"}
    for name, src in trees.items():
        (work / f"ptx_{name}").mkdir(exist_ok=True)
        _programs(src, work / f"ptx_{name}")
    differ = []
    for f in sorted((work / "ptx_base").glob("*.ptx")):
        mine = work / "ptx_this" / f.name
        if not mine.exists() or _instructions(f.read_text()) != _instructions(mine.read_text()):
            differ.append(f.stem)
    n = len(list((work / "ptx_base").glob("*.ptx")))
    print(f"same_code: {n - len(differ)} of {n} programs compile to the same PTX as {a.base}")
    for name in differ:
        print(f"  differs: {name}")
    return 1 if differ else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(main())
