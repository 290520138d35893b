"""Launching ropekit's Triton kernels with little host time (decode and training steps are host-bound).

Triton's generic launcher binds and specializes every argument on each call (~40 for these
kernels), tens of microseconds per launch on the H200 host. Once the kernel for a call signature
is compiled, `launch` calls the compiled kernel directly with the argument list Triton itself
passes, pointers as integers: the compiled launcher then skips, per pointer, a `data_ptr()` call
and a driver query that only exists to reject CPU tensors (the ops have validated devices).
"""

from __future__ import annotations

import os

import torch

# the current CUDA device, read without torch.cuda's lazy-init wrapper: a launch has CUDA tensors, so
# CUDA is initialized by then
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)

# how each launch went (the benchmarks print it); "ok" turns off for a Triton whose launcher differs
COUNTS = {"direct": 0, "generic": 0}
# host_only: CPU tensors take the direct path too, with a compiled entry that launches nothing (seeded by
# benchmarks/scripts/profile_host.py --stub-launch: the Python host time of a call, timed without a GPU)
_STATE = {"ok": os.environ.get("ROPEKIT_DIRECT_LAUNCH", "1") == "1", "tools": None, "host_only": False}


def launch(
    kernel, compiled: dict, variant, grid, ptrs, args, meta, addrs=None, bits=None, guarded: bool = False
) -> None:
    """kernel[grid](*ptrs, *args, **meta), directly when possible.

    compiled: the caller's cache (one per launch plan) of compiled kernels. variant: the part of
    meta that may change from call to call under one plan (a fallback for a misaligned pointer).
    Triton specializes pointers on 16-byte alignment, so that is part of the cache key too.
    addrs: the pointers' addresses in slot order, when the caller has read them (each operand's
    address is then read once per call); None reads them here. bits: with addrs, their OR (the
    alignment test's input) when the caller has it; None ORs them here. One function on the
    steady-state path (no helper calls: each costs host time on every launch); guarded: called
    again inside the device guard (the tensors' device made current).
    """
    device = ptrs[0].get_device()  # -1 on CPU
    if device < 0 and not _STATE["host_only"]:
        kernel[grid](*ptrs, *args, **meta)  # the interpreter, on CPU tensors
        return
    if not guarded and device != current_device():
        # the device guard: launch on the device of the tensors (validation put every tensor of the
        # call on q's), not on whichever device is current, and on that device's current stream
        with torch.cuda.device(device):
            launch(kernel, compiled, variant, grid, ptrs, args, meta, addrs, bits, True)
        return
    if addrs is None:  # a tensor in several slots in a row (slots a plan never reads) is asked once
        addrs, last, a, bits = [], None, 0, 0
        for p in ptrs:
            if p is not last:
                last = p
                a = p.data_ptr()
                bits |= a
            addrs.append(a)
    elif bits is None:
        bits = 0
        for a in addrs:
            bits |= a
    # Triton specializes each pointer on 16-byte alignment: one flag when all are aligned (the usual case)
    if bits & 15 == 0:
        key = (variant, True)
    else:
        key = [variant]
        for a in addrs:
            key.append(a & 15 == 0)
        key = tuple(key)
    entry = compiled.get(key)
    if entry is not None and _STATE["ok"]:
        try:
            tools = _STATE["tools"]
            if tools is None:
                tools = _STATE["tools"] = stream_tools()
            current_stream, runtime = tools
            # the entry: the compiled kernel's launcher, the grid's three dims, the launch fields the
            # compiled kernel fixes, the constexprs' values (fixed by the plan), the compiled kernel
            run, gx, gy, gz, function, packed, consts, kernel_run = entry
            stream = current_stream(device)
            enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
            # launch metadata only feeds the launch hooks (profilers): none registered (an empty hook
            # chain), no metadata and no hook calls from the compiled launcher
            metadata = None
            if enter is not None:
                if getattr(enter, "calls", True):
                    metadata = kernel_run.launch_metadata((gx, gy, gz), stream, *addrs, *args, *consts)
                else:
                    enter = None
            if leave is not None and not getattr(leave, "calls", True):
                leave = None
            # (grid, stream, launch fields, pointers, ints, constexprs)
            run(gx, gy, gz, stream, function, packed, metadata, enter, leave, *addrs, *args, *consts)
            COUNTS["direct"] += 1
            return
        except (ImportError, AttributeError, TypeError):
            _STATE["ok"] = False  # a Triton whose launcher differs: its generic path from now on
    kernel_run = kernel[grid](*ptrs, *args, **meta)
    COUNTS["generic"] += 1
    if kernel_run is not None and hasattr(kernel_run, "run"):
        try:  # the launcher and the launch fields, read once (the compiled kernel is loaded by now)
            fields = (kernel_run.run, *(*grid, 1, 1)[:3], kernel_run.function, kernel_run.packed_metadata)
        except AttributeError:  # a Triton whose compiled kernel differs: its generic path
            return
        names = [p.name for p in kernel.params if p.is_constexpr]
        compiled[key] = (*fields, tuple(meta[n] for n in names), kernel_run)


def record(compiled: dict, variant, device: int):
    """(the compiled launcher, the grid's three dims, its launch fields, the constexprs' values, the
    direct launch's state, its stream tools): what a launch record (ropekit.core.pipeline's
    rotate_record, store_record, rerotate_record) needs to launch `variant` with every pointer
    16-byte aligned, without this module's per-call steps. None while that kernel is not compiled
    or a direct launch is off; False for tensors on `device` -1 (CPU: the interpreter runs them,
    never a direct launch)."""
    if device < 0 and not _STATE["host_only"]:
        return False
    entry = compiled.get((variant, True))
    if entry is None or not _STATE["ok"] or _STATE["tools"] is None:
        return None
    return (*entry[:7], _STATE, _STATE["tools"])


def hooked(runtime) -> bool:
    """Has a profiler registered a launch hook (Triton's knobs.runtime)? Such a launch goes through
    `launch`, which hands the hooks the launch's metadata."""
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or (
        leave is not None and bool(getattr(leave, "calls", True))
    )


def stream_tools():
    """(current_stream(device) -> raw stream, Triton's runtime knobs): what a direct launch needs."""
    import triton
    from triton import knobs

    return triton.runtime.driver.active.get_current_stream, knobs.runtime
