"""Usage: PYTHONPATH=src python benchmarks/scripts/qkv_compile_check.py [--path packed|tma|pointer] [--norm]
        [--interleaved] [--pre] [--cache] [--sm 90] [--dump DIR] [KEY=VALUE ...]

What Triton makes of the QKV projection kernel (ropekit.kernels.qkv_gemm) for a GPU, without one:
the kernel compiled for sm_90 (default) at Llama-3-8B's head shape (hidden 4096, head size 128,
bf16), with the path and tile config given (KEY=VALUE overrides tile_config's entries: G, BLOCK_M,
BLOCK_K, GROUP_M, num_warps, num_stages, WARP_SPEC, PERSISTENT). Prints the wgmma instruction shapes of the
PTX, the layout conversions (`ttg.convert_layout`) and shared-memory allocations (`ttg.local_alloc`)
of the TTGIR after the main loop (each with the tensor type it moves), and ptxas's registers and
spills (Triton's own ptxas). --dump DIR writes the TTGIR and PTX there.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

D, HIDDEN, HQ, HK = 128, 4096, 32, 8


def signature(kernel, cfg: dict, path: str, a) -> tuple:
    """(signature, constexprs, attributes) of one launch as Triton's launcher specializes it:
    16-byte aligned pointers, ints divisible by 16 marked so, unit strides as constants."""
    g, bm, bk = cfg["G"], cfg["BLOCK_M"], cfg["BLOCK_K"]
    half = D // 2
    desc = path in ("tma", "packed")
    ptrs = {"x_ptr": "bf16", "w_ptr": "bf16", "out_ptr": "bf16", "pre_ptr": "bf16", "pos_ptr": "i64"}
    ptrs.update(cache_ptr="fp32", wq_ptr="bf16", wk_ptr="bf16", kc_ptr="bf16", vc_ptr="bf16", slot_ptr="i64")
    rows_w = g * D if path == "packed" else half
    descs = {"x_desc": f"tensordesc<bf16[{bm}, {bk}]>", "w_desc": f"tensordesc<bf16[{rows_w}, {bk}]>"}
    ints = dict(T=32768, K=HIDDEN, n_q_heads=HQ, n_k_heads=HK, max_position=32768, stride_xm=HIDDEN, stride_xk=1)
    ints.update(stride_wn=HIDDEN, stride_wk=1, stride_om=(HQ + 2 * HK) * D, stride_oh=D)
    ints.update(stride_pm=(HQ + HK) * D, stride_ph=D, stride_pos=1, stride_cache=D, num_slots=32768, block_size=16)
    ints.update(stride_slot=1, stride_kb=16 * HK * D, stride_ks=HK * D, stride_kh=D)
    ints.update(stride_vb=16 * HK * D, stride_vs=HK * D, stride_vh=D)
    consts = dict(D=D, HALF=half, HALF_PAD=half, TAIL_PAD=0, G=g, INTERLEAVED=a.interleaved)
    consts.update(NORM_Q=int(a.norm), NORM_K=int(a.norm), PRE=a.pre, EVEN_K=True, PRECISION="tf32", UPCAST=False)
    consts.update(BLOCK_M=bm, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], TMA=path == "tma", CACHE=a.cache)
    consts.update(PACKED=path == "packed", WARP_SPEC=bool(cfg.get("WARP_SPEC", False)) and path == "packed")
    consts.update(PERSISTENT=bool(cfg.get("PERSISTENT", False)))
    sig, const, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        n = p.name
        if p.is_constexpr:
            sig[n], const[n] = "constexpr", consts[n]
        elif n in ptrs:
            sig[n], attrs[(i,)] = "*" + ptrs[n], [["tt.divisibility", 16]]
        elif n in descs or n == "wt_desc":
            if desc and n in descs:
                sig[n] = descs[n]
            else:  # None: a constant
                sig[n], const[n] = "constexpr", None
        elif n == "eps":
            sig[n] = "fp32"
        elif ints[n] == 1:
            sig[n], const[n] = "constexpr", 1
        else:
            sig[n] = "i32"
            if ints[n] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, const, attrs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default="packed", choices=("packed", "tma", "pointer"))
    p.add_argument("--norm", action="store_true", help="q/k RMSNorm in the epilogue (Qwen3)")
    p.add_argument("--interleaved", action="store_true")
    p.add_argument("--pre", action="store_true", help="also store the heads before norm and rotation")
    p.add_argument("--cache", action="store_true", help="the paged-cache write")
    p.add_argument("--sm", type=int, default=90)
    p.add_argument("--dump", default=None)
    p.add_argument("overrides", nargs="*", help="KEY=VALUE tile config entries")
    a = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["ROPEKIT_QKV_PATH"] = a.path
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ropekit.kernels import qkv_gemm

    cfg = qkv_gemm.tile_config(32768, HIDDEN, D, D, HQ, HK, True)
    for item in a.overrides:
        key, _, value = item.partition("=")
        cfg[key] = int(value)
    cfg.pop("TMA", None), cfg.pop("PACKED", None)
    sig, const, attrs = signature(qkv_gemm.qkv_rope_gemm_kernel, cfg, a.path, a)
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    compiled = triton.compile(
        ASTSource(qkv_gemm.qkv_rope_gemm_kernel, sig, const, attrs), target=GPUTarget("cuda", a.sm, 32), options=opts
    )
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for ext, text in (("ttgir", ttgir), ("ptx", ptx)):
            with open(os.path.join(a.dump, f"qkv_{a.path}.{ext}"), "w") as f:
                f.write(text)
    print(f"path {a.path}, config {cfg}, norm {a.norm}, interleaved {a.interleaved}, pre {a.pre}, cache {a.cache}")
    shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
    print(f"wgmma shapes: {shapes or 'none'}")
    body = ttgir.split("scf.yield", 1)[-1] if "scf.for" in ttgir else ttgir
    after = body.split("tt.return", 1)[0]
    for op in ("ttg.convert_layout", "ttg.local_alloc"):
        found = [ln.strip() for ln in after.splitlines() if op in ln]
        print(f"{op} after the main loop: {len(found)}")
        for ln in found:
            print("   ", re.sub(r"\s+loc\(.*$", "", ln)[:200])
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    arch = f"sm_{a.sm}a" if a.sm >= 90 else f"sm_{a.sm}"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        for name in ("ptxas", "ptxas-blackwell"):
            exe = os.path.join(bin_dir, name)
            if not os.path.exists(exe):
                continue
            out = subprocess.run(
                [exe, "-v", "--gpu-name", arch, f.name, "-o", os.devnull], capture_output=True, text=True
            )
            lines = [ln.split(":", 1)[-1].strip() for ln in out.stderr.splitlines() if "Used" in ln or "spill" in ln]
            if out.returncode == 0 and lines:
                print(f"ptxas ({name}): " + "; ".join(lines))
                break
        else:
            print("no ptxas of this Triton assembled the PTX", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
