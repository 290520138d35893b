"""Smoke test of the benchmark CLI (python -m ropekit.tools.bench) in its CPU mode.

Runs two workloads at the quick sizes on the CPU into tmp_path and checks what it writes: the
JSON, the table (which must say these are CPU numbers), the markdown, and the PNG when
matplotlib is importable (a message saying why not, otherwise).
"""

import importlib.util
import json
import time

import pytest
import torch

from ropekit.tools.bench import report, workloads
from ropekit.tools.bench.__main__ import main


@pytest.fixture
def cpu_env(monkeypatch):
    # the pure-PyTorch CPU path, not the Triton interpreter: this is a smoke test of the CLI
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_bench_cli_cpu_quick(tmp_path, capsys, cpu_env):
    out = tmp_path / "bench"
    md = tmp_path / "RESULTS.md"
    rc = main(
        [
            "--device",
            "cpu",
            "--quick",
            "--workloads",
            "train_8b,W3",  # W1 by its name: the id would select its group (W1-SBHD too)
            "--out",
            str(out),
            "--results-md",
            str(md),
            "--no-progress",
            "--peers",
            "ropekit,reference,torch-eager",
            "--rep-ms",
            "10",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "CPU numbers" in text and "not GPU numbers" in text

    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["cpu_mode"] is True and res["meta"]["partial"] is False
    assert [w["id"] for w in res["workloads"]] == ["W1", "W3", "W3-1"]  # W3 selects W3-1 too
    cells = {(r["workload"], r["peer"]): r for r in res["results"]}
    # W3-1 is a CUDA-graph measurement: every cell skipped with the reason, nothing timed
    for peer in ("ropekit", "reference", "torch-eager"):
        r = cells[("W3-1", peer)]
        assert r["status"] == "skipped" and "CUDA-graph" in r["reason"] and r["time_us"] is None, r
    # the same-size copy: measured for the per-call row (W1), none for the graph row (W3)
    by_wl = {w["id"]: w for w in res["workloads"]}
    w1 = by_wl["W1"]
    assert w1["same_size_copy_bytes"] == w1["bytes"] and w1["same_size_copy_gbps"] > 0
    assert w1["same_size_copy_pct"] == pytest.approx(100 * w1["same_size_copy_gbps"] / res["copy"]["gbps"])
    assert w1["same_size_copy_spread"]["min"] <= w1["same_size_copy_spread"]["max"]
    rk = cells[("W1", "ropekit")]
    assert rk["pct_same_size_copy"] == pytest.approx(100 * rk["gbps"] / w1["same_size_copy_gbps"])
    assert by_wl["W3"]["same_size_copy_gbps"] is None and cells[("W3", "ropekit")]["pct_same_size_copy"] is None
    # the CPU table: times and ratios to the HF-code column, no percentages of a CPU memcpy
    assert report.SAME_HEADER not in text and "memcpy" not in text and "% (" not in text
    hf_w1 = cells[("W1", "torch-eager")]["time_us"]
    assert f"({rk['time_us'] / hf_w1:.2f}x HF" in text and "(1.00x HF" in text
    # the reference and the HF code must run and pass the float64 check everywhere
    for wl in ("W1", "W3"):
        for peer in ("reference", "torch-eager"):
            r = cells[(wl, peer)]
            assert r["status"] == "ok", r
            assert r["time_us"] > 0 and r["pct_copy"] > 0
            assert max(r["rel_err"].values()) <= 1e-2
        r = cells[(wl, "ropekit")]
        assert r["status"] == "ok", r  # ropekit itself is never skipped
        assert max(r["rel_err"].values()) <= 1e-2 and r["time_us"] > 0
        sp = r["time_spread"]
        assert sp["min"] <= sp["median"] <= sp["max"] and sp["n"] >= 3
    # W3 is a host workload: host time with its spread, and the floors measured in the same run
    w3 = next(w for w in res["workloads"] if w["id"] == "W3")
    floors = w3["host_floors"]
    assert floors["interpreted"] is True
    for name in ("launch", "aten", "autograd"):
        assert floors[name] and floors[name]["median"] > 0, (name, floors)
    assert cells[("W3", "ropekit")]["host_us"] > 0
    assert "W3 host floors [TRITON INTERPRETER" in text and "x launch" in text and "x aten" in text
    assert "[min-max]" in text
    cpu = res["meta"]["cpu_speed"]
    assert cpu["bfloat16"]["hf"]["median"] > 0 and cpu["float32"]["ropekit.apply_rope"]["median"] > 0
    # GPU-only peers are listed as skipped with a reason, never faked
    peers = {p["name"]: p for p in res["peers"]}
    assert not peers["liger"]["available"] and peers["liger"]["reason"]
    assert res["copy"]["gbps"] > 0

    assert "CPU numbers" in (out / "results.txt").read_text()
    assert "CPU" in md.read_text() and "| W1 train_8b |" in md.read_text()
    assert "| time / HF |" in md.read_text() and "% copy" not in md.read_text()
    assert "| W3-1 decode_b64_one_set |" in md.read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib.image

        # readable at its size: one 1320 px wide panel for the two timed workloads, 110 dpi
        assert matplotlib.image.imread(str(out / "results.png")).shape[:2] == (440, 1320)
    else:
        assert "no PNG" in text


def test_wrong_output_is_reported_not_timed(cpu_env):
    """A peer whose output is off is marked wrong and has no time."""
    from ropekit.tools.bench import peers as P
    from ropekit.tools.bench import runner

    class Broken(P.TorchEager):
        name = "broken"

        def make(self, wl, inp):
            b = super().make(wl, inp)
            return P.Bound(lambda: tuple(t * 1.1 for t in b.fn()), b.canon)

    wl = workloads.BY_ID["W1"]
    s = wl.sizes(True)
    table = workloads.make_table(wl, s, "cpu")
    base = workloads.make_inputs(wl, s, table, "cpu", 0)
    exp = workloads.expected(wl, base, workloads.Oracle())
    cfg = runner.Config(workloads=[wl], device="cpu", progress=False)
    rec = runner.run_one(Broken(), wl, base, exp, [], workloads.min_bytes(wl, base), 10.0, "cpu", cfg)
    assert rec["status"] == "wrong" and rec["time_us"] is None
    assert "WRONG" in report._cell(rec, False)


def test_fp8_outputs_checked_at_fp8_error(cpu_env):
    """W10-FP8: the cache rows are checked at e4m3's quantization error against the float64 values
    rounded once to fp8 (the HF code rounds to bf16 first: about one fp8 step off here and there,
    inside that error and above bf16's); a WRONG cell names the output, its error and tolerance."""
    from ropekit.tools.bench import peers as P
    from ropekit.tools.bench import runner

    wl = workloads.BY_ID["W10-FP8"]
    s = wl.sizes(True)
    table = workloads.make_table(wl, s, "cpu")
    base = workloads.make_inputs(wl, s, table, "cpu", 0)
    exp = workloads.expected(wl, base, workloads.Oracle())
    cfg = runner.Config(workloads=[wl], device="cpu", progress=False, rep_ms=5)
    rec = runner.run_one(P.TorchEager(), wl, base, exp, [], 1, 10.0, "cpu", cfg)
    assert rec["status"] == "ok", rec
    assert rec["tolerance"]["k_cache[slots]"] == workloads.tolerance(torch.float8_e4m3fn)
    assert rec["tolerance"]["q"] == workloads.tolerance(torch.bfloat16)
    worst = rec["rel_err"]["k_cache[slots]"]
    assert workloads.tolerance(torch.bfloat16) < worst < workloads.tolerance(torch.float8_e4m3fn)
    assert f"worst {worst:.1e}" in rec["note"] and "rounded once to float8_e4m3fn" in rec["note"]
    wrong = dict(rec, status="wrong", rel_err={"q": 1e-3, "k_cache[slots]": 0.2})
    assert report._cell(wrong, False) == "WRONG (k_cache[slots]: err 2.0e-01 > 0.05)"


def test_cpu_rounds_flag_a_ratio_that_moves():
    """A CPU cell timed in rounds with the peers in turn: the time is the median of the rounds'
    medians, and a ratio to the HF column that moves between rounds is flagged in the cell even
    when the calls of each round agree."""
    from ropekit.tools.bench import runner

    def kept(*round_ms):
        rec = {"status": "ok", "time_us": round_ms[0] * 1e3, "gbps": 1.0, "pct_copy": 1.0}
        return rec, {"rounds": [[m] * 3 for m in round_ms]}

    def call_ms(ms):
        return runner.P.Bound(lambda: time.sleep(ms / 1e3), tuple)

    cells = {"ropekit": kept(1.0, 9.0, 1.0), runner.HF_PEER: kept(1.0, 1.0, 1.0)}
    for _, keep in cells.values():
        keep["bound"] = call_ms(0.1)
    cfg = runner.Config(workloads=[], device="cpu", rep_ms=0.0)
    real = runner.CPU_REPEATS
    try:
        runner.CPU_REPEATS = 1  # the rounds given above are all of them
        runner.cpu_rounds(cells, cfg)
    finally:
        runner.CPU_REPEATS = real
    rk, hf = cells["ropekit"][0], cells[runner.HF_PEER][0]
    assert rk["round_us"] == [1e3, 9e3, 1e3] and rk["time_us"] == 1e3
    assert rk["ratio_rounds"] == [1.0, 9.0, 1.0] and rk["ratio_noisy"] and not hf["ratio_noisy"]
    assert "1.00-9.00x over 3 rounds!" in report._cpu_cell(rk, hf["time_us"])
    assert "rounds" not in report._cpu_cell(hf, hf["time_us"])


def test_workload_selection_and_bytes():
    assert [w.id for w in workloads.select("W7")] == [
        "W7",
        "W7-T64",
        "W7-WK",
        "W7-WK-E5M2",
        "W7-NVFP4",
        "W7-T64-WK",
        "W7-KNOPE",
        "W7-QNOPE",
    ]
    assert [w.id for w in workloads.select("W2,W6")] == ["W2", "W2-OUT", "W2-STRIDED", "W2-EAGER", "W6", "W6-LAST"]
    assert [w.id for w in workloads.select("W4")] == ["W4", "W4-N4"]
    assert [w.id for w in workloads.select("w3,train_8b")] == ["W1", "W3", "W3-1"]
    assert [w.id for w in workloads.select("W3-1")] == ["W3-1"]
    assert [w.id for w in workloads.select("decode_b64_one_set")] == ["W3-1"]
    w3, w31 = workloads.BY_ID["W3"], workloads.BY_ID["W3-1"]
    assert w31.one_set_calls == 100 and w31.graph and w3.one_set_calls == 0
    # W3-1 is W3's problem: the same sizes, layout and positions, hence the same inputs per seed
    assert (w31.full, w31.quick, w31.layout, w31.positions) == (w3.full, w3.quick, w3.layout, w3.positions)
    with pytest.raises(ValueError):
        workloads.select("W99")
    assert [w.id for w in workloads.select("W10")] == [
        "W10",
        "W10-FP8",
        "W10-T64",
        "W10-T64-FP8",
        "W10-FP8Q",
        "W10-T64-FP8Q",
    ]
    # WORKLOADS.md: W1 moves q and k once each way: 2 * 4*4096*(32+8)*128 * 2 bytes
    wl = workloads.BY_ID["W1"]
    full = wl.sizes(False)
    inp = {
        "q": torch.empty(full["B"], full["S"], full["Hq"], full["D"], dtype=torch.bfloat16, device="meta"),
        "k": torch.empty(full["B"], full["S"], full["Hk"], full["D"], dtype=torch.bfloat16, device="meta"),
    }
    assert workloads.min_bytes(wl, inp) == 2 * 4 * 4096 * 40 * 128 * 2


def test_module_entry_point_lists_workloads():
    """`python -m ropekit.tools.bench --list` runs as a program (what the console script calls)."""
    import os
    import subprocess
    import sys

    import ropekit

    src = os.path.dirname(os.path.dirname(os.path.abspath(ropekit.__file__)))
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-m", "ropekit.tools.bench", "--list"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "W7-T64" in out.stdout and "liger" in out.stdout


def test_norm_workloads_bytes_and_quick_cpu_run(cpu_env):
    """W9/W10: minimal bytes as WORKLOADS.md counts them, and a quick CPU run (the pure-PyTorch
    path, like the other tests here) of ropekit and ropekit-unfused checked against float64."""
    wl = workloads.BY_ID["W9-FB"]
    full = wl.sizes(False)
    qk = 4 * 4096 * 40 * 128 * 2
    inp = {
        "q": torch.empty(full["B"], full["S"], full["Hq"], full["D"], dtype=torch.bfloat16, device="meta"),
        "k": torch.empty(full["B"], full["S"], full["Hk"], full["D"], dtype=torch.bfloat16, device="meta"),
    }
    assert workloads.min_bytes(workloads.BY_ID["W9"], inp) == 2 * qk
    assert workloads.min_bytes(wl, inp) == 5 * qk  # forward 2x, backward: x and g read, gx written
    from ropekit.tools.bench import peers, runner  # noqa: F401

    for wid in ("W9", "W9-L2", "W9-FB", "W10", "W10-FP8"):
        w = workloads.BY_ID[wid]
        s = w.sizes(True)
        s.update(B=1, S=16, T=16) if "B" in s else s.update(T=16)
        _peers_match_float64(w, s, (peers.Ropekit(), peers.RopekitUnfused()))


def _peers_match_float64(w, s, peer_list):
    """Each peer's outputs on one quick CPU input set within the bf16 tolerance of the oracle."""
    table = workloads.make_table(w, s, "cpu")
    base = workloads.make_inputs(w, s, table, "cpu", 0)
    exp = workloads.expected(w, base, workloads.Oracle())
    for p in peer_list:
        inp2 = workloads.clone_inputs(base)
        bound = p.make(w, inp2)
        got = workloads.canon(w, inp2, bound.canon(bound.fn()))
        errs = {n: workloads.rel_err(got[n], e) for n, e in exp.items()}
        assert max(errs.values()) <= workloads.tolerance(torch.bfloat16), (w.id, p.name, errs)
    return base


def test_one_set_graph_row_plumbing(cpu_env, monkeypatch):
    """W3-1's CUDA branch of run_one, with the graph timing replaced by a recorder (no GPU here):
    ONE input set, called wl.one_set_calls times per graph, and the row's figures derived from
    what the timing returned."""
    from ropekit.tools.bench import peers as P
    from ropekit.tools.bench import runner, timing

    seen = {}

    def fake_graph_ms(fns, warmup_ms, rep_ms, all_stats=False, calls_per_set=1):
        seen.update(n_fns=len(fns), calls=calls_per_set)
        for f in fns:  # the function handed over must be the peer's call on its inputs
            f()
        return {"min": 0.0015, "median": 0.002, "max": 0.003, "n": 10, "noisy": False}

    monkeypatch.setattr(timing, "graph_ms", fake_graph_ms)
    monkeypatch.setattr(runner, "_sync", lambda device: None)
    wl = workloads.BY_ID["W3-1"]
    s = dict(wl.sizes(True), T=8)
    table = workloads.make_table(wl, s, "cpu")
    base = workloads.make_inputs(wl, s, table, "cpu", 0)
    exp = workloads.expected(wl, base, workloads.Oracle())
    nbytes = workloads.min_bytes(wl, base)
    cfg = runner.Config(workloads=[wl], device="cpu", progress=False)
    rec = runner.run_one(P.Ropekit(), wl, base, exp, [], nbytes, 100.0, "cuda", cfg)
    assert rec["status"] == "ok", rec
    assert seen == {"n_fns": 1, "calls": 100}
    assert rec["time_us"] == pytest.approx(2.0) and rec["time_spread"]["max"] == pytest.approx(3.0)
    assert "one input set, 100 calls per graph" in rec["method"]
    assert rec["host_us"] is None  # W3 measures the host time; W3-1 does not repeat it


def test_graph_ms_and_same_size_copy_arguments():
    from ropekit.tools.bench import timing

    with pytest.raises(ValueError, match="graph_ms: calls_per_set: expected an int >= 1, got 0"):
        timing.graph_ms([lambda: None], calls_per_set=0)
    c = timing.same_size_copy("cpu", 1 << 16, rep_ms=5)
    assert c["bytes"] == 1 << 16 and c["gbps"] > 0
    assert c["time_us"] == pytest.approx(c["spread"]["min"])  # CPU: the fastest, as the CPU memcpy


def test_report_one_set_row_and_floor():
    """A GPU-shaped result (as the H200 run writes it): the W3-1 row shows its time over the
    in-graph launch floor, the floor has its own line, and the same-size column reads the JSON."""
    st = lambda med: {"min": med * 0.9, "median": med, "max": med * 1.1, "n": 9, "noisy": False}  # noqa: E731
    floor = {**st(0.5), "calls_per_graph": 100, "what": "empty Triton kernel, 100 launches in one CUDA graph"}

    def wl(wid, graph, same=None, gfloor=None):
        return {
            "id": wid,
            "name": wid.lower(),
            "what": "",
            "sizes": {"T": 64},
            "bytes": 1000,
            "floor_us": 0.1,
            "graph": graph,
            "host": False,
            "input_sets": 1,
            "same_size_copy_gbps": same,
            "same_size_copy_pct": None if same is None else 90.0,
            "same_size_copy_us": None if same is None else 1.0,
            "graph_launch_floor": gfloor,
        }

    def rec(wid, t, pct_same=None):
        return {
            "workload": wid,
            "peer": "ropekit",
            "status": "ok",
            "reason": "",
            "time_us": t,
            "gbps": 1.0,
            "pct_copy": 80.0,
            "pct_same_size_copy": pct_same,
            "host_us": None,
            "time_spread": st(t),
            "method": "m",
            "rel_err": {"q": 0.0},
            "note": "",
        }

    res = {
        "meta": {
            "cpu_mode": False,
            "quick": False,
            "device": "GPU",
            "dtype": "bfloat16",
            "date": "d",
            "partial": False,
        },
        "copy": {"gbps": 4000.0, "what": "copy"},
        "workloads": [wl("W2", False, same=3600.0), wl("W3-1", True, gfloor=floor)],
        "peers": [{"name": "ropekit", "label": "ropekit", "available": True, "version": "0", "reason": ""}],
        "results": [rec("W2", 300.0, pct_same=97.5), rec("W3-1", 1.8)],
    }
    text = report.terminal(res)
    assert "90.0%; ropekit 97.5%" in text
    assert "1.80 us [1.62-1.98] (3.6x in-graph launch)" in text
    assert "W3-1 graph floor: empty Triton kernel, 100 launches in one CUDA graph: 0.50 us" in text
    md = report.markdown(res)
    assert "3600 GB/s, 1.00 us (90.0% of copy)" in md and "97.5%" in md


def test_axial_workloads_bytes_and_quick_cpu_run(cpu_env):
    """W13-W15: minimal bytes, and a quick CPU run of ropekit (angles from positions x frequencies,
    the norm fused) and of diffusers' code (torch eager) against float64."""
    from ropekit.tools.bench import peers

    w14 = workloads.BY_ID["W14"]
    full = w14.sizes(False)
    q = torch.empty(1, 21 * 45 * 80, full["H"], full["D"], dtype=torch.bfloat16, device="meta")
    assert workloads.min_bytes(w14, {"q": q, "k": q}) == 2 * 2 * q.numel() * 2
    assert workloads.min_bytes(workloads.BY_ID["W14-FB"], {"q": q, "k": q}) == 5 * 2 * q.numel() * 2
    assert [w.id for w in workloads.select("W8")] == ["W8", "W8-G"]
    assert workloads.BY_ID["W8-G"].graph and workloads.BY_ID["W8-G"].kind == "fwdbwd"
    assert [w.id for w in workloads.select("W13")] == ["W13", "W13-FB", "W13-G"]
    assert workloads.BY_ID["W13-G"].graph and not workloads.BY_ID["W13"].graph
    for wid in ("W13", "W13-FB", "W13-G", "W14", "W14-FB", "W15"):
        w = workloads.BY_ID[wid]
        base = _peers_match_float64(w, w.sizes(True), (peers.Ropekit(), peers.Reference(), peers.TorchEager()))
        with pytest.raises(peers.PeerSkip):
            peers.Liger().make(w, base)


def test_gpu_plot_has_one_panel_per_eight_workloads(tmp_path):
    """The chart stays readable however many workloads ran: 8 groups of bars a panel, the width
    fixed, the height growing by a panel; `peers` picks and orders the implementations."""
    pytest.importorskip("matplotlib")
    import matplotlib.image

    st = {"min": 1.0, "median": 1.0, "max": 1.0, "n": 3, "noisy": False}
    wls = [{"id": f"W{i}", "name": f"w{i}", "graph": i == 3} for i in range(1, 12)]
    peers = [{"name": n, "label": n, "available": True} for n in ("ropekit", "liger", "torch-eager")]
    results = [
        {"workload": w["id"], "peer": p["name"], "status": "ok", "pct_copy": 50.0, "time_us": 1.0, "time_spread": st}
        for w in wls
        for p in peers
    ]
    res = {"meta": {"cpu_mode": False, "device": "GPU", "date": "2026-12-01"}, "workloads": wls, "peers": peers}
    res["results"] = results
    ok, path = report.write_png(res, str(tmp_path / "p.png"), peers=["ropekit", "torch-eager"])
    assert ok, path
    assert matplotlib.image.imread(path).shape[:2] == (770, 1320)  # two panels: (2 * 3.0 + 1.0) in at 110 dpi


def test_cpu_launch_floor_in_a_fresh_process():
    # The CPU rows run with TRITON_INTERPRET unset; the interpreter's first launch in a process
    # imports Triton modules that assert the interpret knob. A fresh process, so that no earlier
    # launch has done that import: the launch floor must still be measured.
    import subprocess
    import sys

    script = (
        "import os, json, torch, triton.language\n"
        "import ropekit\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "from ropekit.tools.bench import timing\n"
        "f = timing.host_floors(torch.zeros(4))\n"
        "print(json.dumps({'launch': f['launch'], 'why': f['why']}))\n"
    )
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["why"] == {} and got["launch"]["median"] > 0, got


def test_vllm_plugin_forward_row(tmp_path, cpu_env):
    # the plugin's forward on a module holding vLLM's attributes: timed, and checked against the
    # float64 oracle like every cell; a workload it has no form for is skipped with the reason
    out = tmp_path / "bench"
    argv = ["--device", "cpu", "--quick", "--workloads", "W3,W4", "--out", str(out), "--no-progress"]
    assert main(argv + ["--peers", "ropekit-vllm", "--rep-ms", "10", "--no-plot"]) == 0
    cells = {r["workload"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    r = cells["W3"]
    assert r["status"] == "ok" and r["time_us"] > 0 and max(r["rel_err"].values()) <= 1e-2, r
    assert r["host_us"] > 0
    assert cells["W4"]["status"] != "ok", cells["W4"]


def ropekit_row_passes(w, sizes):
    """The ropekit peer's call of row w at these sizes passes the row's float64 check (on the CPU
    tensors given, as the bench's CPU mode runs); returns the row's base inputs."""
    from ropekit.core import memo
    from ropekit.tools.bench import peers

    memo.clear()
    table = workloads.make_table(w, sizes, "cpu")
    base = workloads.make_inputs(w, sizes, table, "cpu", 0)
    exp = workloads.expected(w, base, workloads.Oracle())
    inp = workloads.clone_inputs(base)
    bound = peers.Ropekit().make(w, inp)
    got = workloads.canon(w, inp, bound.canon(bound.fn()))
    assert set(got) == set(exp)
    errs = {n: workloads.rel_err(got[n], e) for n, e in exp.items()}
    assert max(errs.values()) <= workloads.tolerance(torch.bfloat16), errs
    memo.clear()
    return base


CONVENTION_ROWS = (
    "W7-KNOPE",
    "W7-QNOPE",
    "W1-SBHD",
    "W1-HEADTABLE",
    "W1-QTEMP",
    "W2-OUT",
    "W2-STRIDED",
    "W2-EAGER",
    "W6-LAST",
)


@pytest.mark.parametrize("wid", CONVENTION_ROWS)
def test_convention_rows_check_and_bytes(cpu_env, wid):
    """The rows of issue #33's conventions: the ropekit call passes the plain row's float64 check
    (pure-PyTorch CPU path, as the bench's CPU mode runs); the bytes are the plain row's, except
    that a q rotated in place on a narrower table moves its rotated dims only, and an fp8 q_out
    is written at one byte; other peers are n/a."""
    from ropekit.tools.bench import peers

    w = workloads.BY_ID[wid]
    s = w.sizes(True)
    base = ropekit_row_passes(w, dict(s, T=16) if w.kind == "store" else s)
    nb = lambda x: x.numel() * x.element_size()  # noqa: E731
    plain = workloads.BY_ID[w.group]
    if w.kind != "store":
        assert workloads.min_bytes(w, base) == workloads.min_bytes(plain, base)
    else:
        q, k, v, kc = base["q"], base["k"], base["v"], base["k_cache"]
        rows = (k.numel() + v.numel()) * kc.element_size()
        q_moved = nb(q) + q.numel() if "q_nope" in w.store_forms else 2 * nb(q) * 64 // 128
        assert workloads.min_bytes(w, base) == q_moved + nb(k) + nb(v) + rows
    with pytest.raises(peers.PeerSkip):
        peers.forms_only_ropekit(peers.Reference(), w)


def test_q_temperature_row_checks_a_factor_that_varies(cpu_env):
    """W1-QTEMP's expected q is W1's times a factor that takes several values at the quick size
    (so the check would catch a scaling left out or wrong), and its k is W1's."""
    w, w1 = workloads.BY_ID["W1-QTEMP"], workloads.BY_ID["W1"]
    base = ropekit_row_passes(w, w.sizes(True))
    exp, plain = workloads.expected(w, base, workloads.Oracle()), workloads.expected(w1, base, workloads.Oracle())
    assert workloads.rel_err(exp["k"], plain["k"]) == 0
    ratio = exp["q"].norm(dim=(-2, -1)) / plain["q"].norm(dim=(-2, -1))  # (B, S): q's factor per token
    assert ratio.min() == pytest.approx(1.0) and ratio.max() > 1.1, (ratio.min(), ratio.max())


def test_mrope_n4_row_checks_and_moves_w4s_bytes(cpu_env):
    """W4-N4 (4 position rows, ERNIE's layout): the ropekit call passes the float64 check, whose
    two oracles (ropekit.tools.reference and the bench's own rows) agree; W4's bytes; peers with
    Qwen2-VL's three chunks only are n/a."""
    from ropekit.tools.bench import peers

    w, w4 = workloads.BY_ID["W4-N4"], workloads.BY_ID["W4"]
    s = dict(w.sizes(True), T=8)
    base = ropekit_row_passes(w, s)
    assert base["positions"].shape == (4, 8)
    oracle = workloads.Oracle()
    workloads.expected(w, base, oracle)
    assert oracle.disagreements == [] and "cross-checked" in oracle.name
    assert workloads.min_bytes(w, base) == workloads.min_bytes(w4, base)
    with pytest.raises(peers.PeerSkip):
        peers.TorchEager().make(w, base)
