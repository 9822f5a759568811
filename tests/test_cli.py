"""The ``mqa-bwd`` command line on the CPU: help, argument errors, check, fuzz (with crashes), bench.

check and fuzz are driven against a small stand-in property suite written
below (same plugin options, summary and failure files as the project's), so
that their own behaviour is tested whatever state the real suite is in; the
tests against the real suite skip, saying why, until it exists.
"""

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mqa_bwd import backends, bench, capture, cli, fuzz
from properties import plugin
from properties.case import Case

ROOT = Path(__file__).resolve().parents[1]
REAL_SUITE = cli.DEFAULT_SUITE
#: The stand-in suite brings its own plugin: the installed one (entry point "mqa_bwd") stays out.
NO_PLUGIN = ("--", "-p", "no:mqa_bwd")

STUB_CONFTEST = '''
"""Stand-in for the property harness's plugin: its options, its summary JSON and its failure files."""
import importlib, json, os
from pathlib import Path

import pytest
from hypothesis import Phase, settings

PROFILES = {"ci": dict(max_examples=4, derandomize=True), "dev": dict(max_examples=3),
            "fuzz": dict(max_examples=100000), "repro": dict(max_examples=1)}
PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink)  # no "explain": it reruns 100 times
for _name, _kw in PROFILES.items():
    settings.register_profile("stub-" + _name, deadline=None, database=None, phases=PHASES, **_kw)
CASES, RESULTS = {}, {}


def pytest_addoption(parser):
    for name, default in (("--impl", "mqa_bwd:mqa_latent_sparse_bwd"), ("--backend", None), ("--repeats", "3"),
                          ("--summary-json", None), ("--failures-dir", None), ("--heads", "1-8"),
                          ("--mqa-profile", None)):
        parser.addoption(name, default=default)


def pytest_configure(config):
    settings.load_profile("stub-" + (config.getoption("--mqa-profile") or "ci"))


@pytest.fixture(scope="session")
def options(pytestconfig):
    get = pytestconfig.getoption
    module, _, name = get("--impl").partition(":")
    function = getattr(importlib.import_module(module), name)
    lo, _, hi = get("--heads").partition("-")
    return {"call": lambda *a: function(*a, backend=get("--backend")), "heads": (int(lo), int(hi or lo)),
            "repeats": int(get("--repeats")), "failures": get("--failures-dir"), "backend": get("--backend"),
            "impl": get("--impl")}


def save_failure(options, prop, case, report):
    if options["failures"]:
        Path(options["failures"]).mkdir(parents=True, exist_ok=True)
        record = {"case": json.loads(case.to_json()), "property": prop, "backend": options["backend"],
                  "impl": options["impl"], "report": report}
        (Path(options["failures"]) / (prop + ".json")).write_text(json.dumps(record))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    report.user_properties.append(("cases", CASES.get(item.name, 0)))
    return report


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        name = report.nodeid.split("::")[-1].replace("test_property_", "")
        verdict = {"passed": "pass", "failed": "fail", "skipped": "skip"}[report.outcome]
        RESULTS[name] = {"verdict": verdict, "cases": dict(report.user_properties).get("cases", 0),
                         "seconds": report.duration}


def pytest_sessionfinish(session):
    path = session.config.getoption("--summary-json")
    if path and not hasattr(session.config, "workerinput"):
        Path(path).write_text(json.dumps({"properties": RESULTS, "backend": session.config.getoption("--backend"),
                                          "impl": session.config.getoption("--impl")}))
'''

STUB_TESTS = '''
import torch
from hypothesis import given, strategies as st

from conftest import CASES, save_failure
from properties.case import Case, expected, to_framework
from properties.compare import compare
from mqa_bwd.contract import SPEC_ARGS as ARGS


def cases(options):
    lo, hi = options["heads"]
    return st.builds(Case, H=st.integers(lo, hi), S=st.integers(1, 3), L=st.integers(1, 9), seed=st.integers(0, 99))


def run(options, case):
    inputs = case.inputs()
    tensors = to_framework(inputs)
    return inputs, options["call"](*[tensors[k] for k in ARGS])


def test_property_oracle(options):
    @given(cases(options))
    def check(case):
        CASES["test_property_oracle"] = CASES.get("test_property_oracle", 0) + 1
        inputs, got = run(options, case)
        want, baseline = expected(inputs)
        bad = [c.report() for c in map(compare, ("dq", "dkv", "d_attn_sink"), got, want, baseline) if not c.ok]
        if bad:
            save_failure(options, "oracle", case, "\\n".join(bad))
        assert not bad, "\\n".join(bad) + "\\nREPRO: " + case.to_json()
    check()


def test_property_determinism(options):
    @given(cases(options))
    def check(case):
        CASES["test_property_determinism"] = CASES.get("test_property_determinism", 0) + 1
        _, first = run(options, case)
        for _ in range(options["repeats"] - 1):
            _, again = run(options, case)
            for name, a, b in zip(("dq", "dkv", "d_attn_sink"), first, again):
                assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name
    check()
'''

IMPLEMENTATIONS = '''
import os, signal

from mqa_bwd import mqa_latent_sparse_bwd


def wrong(*args, **kwargs):
    """Ours with dq doubled from H = 4 on: a bug the oracle property sees."""
    dq, dkv, dsink = mqa_latent_sparse_bwd(*args, **kwargs)
    return (dq * 2 if dq.shape[2] >= 4 else dq), dkv, dsink


def crashy(*args, **kwargs):
    """Dies like a process after an illegal memory access whenever H == 3; ours otherwise."""
    if args[0].shape[2] == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return mqa_latent_sparse_bwd(*args, **kwargs)


def device_fault(*args, **kwargs):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def chatty_wrong(*args, **kwargs):
    """wrong, printing 300 lines a call: a failure report longer than check shows."""
    print("\\n".join(f"chatter {i}" for i in range(300)))
    return wrong(*args, **kwargs)
'''


@pytest.fixture(scope="session")
def stub(tmp_path_factory):
    """A folder with the stand-in suite and the test implementations (module stub_impls)."""
    folder = tmp_path_factory.mktemp("stub-suite")
    (folder / "conftest.py").write_text(textwrap.dedent(STUB_CONFTEST))
    (folder / "test_properties.py").write_text(textwrap.dedent(STUB_TESTS))
    (folder / "stub_impls.py").write_text(textwrap.dedent(IMPLEMENTATIONS))
    return folder


@pytest.fixture
def in_stub(stub, monkeypatch):
    monkeypatch.chdir(stub)  # 'stub_impls:...' is importable from the current folder, as for a user
    return stub


def _real_suite_missing() -> str | None:
    if not REAL_SUITE.exists() or importlib.util.find_spec("properties.plugin") is None:
        return f"the property suite ({REAL_SUITE} with properties/plugin.py) is not installed"
    return None


# ---------------------------------------------------------------------------
# Help and argument errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("argv, phrases", [
    ([], ["check", "repro", "fuzz", "bench", "promote", "Exit codes"]),
    (["check"], ["'ci'", "property x verdict x cases x time", ".mqa-failures/", "mqa-bwd repro FILE",
                  "mqa-bwd promote FILE"]),
    (["promote"], ["regressions", "replays first", "<property>-<hash>.json"]),
    (["repro"], ["--runs", "capture", "--against", "bitwise", "first run and element", "oracle"]),
    (["fuzz"], ["CUDA_VISIBLE_DEVICES", "--minutes", "crash-*.safetensors", "mqa-bwd repro FILE"]),
    (["bench"], ["dsv32", "fleet", "--shape", "--sweep", "--plot", "det/atomic", "CUDA-event", "--indices",
                 "indexer", "distinct"]),
])
def test_help_teaches_each_command(capsys, argv, phrases):
    with pytest.raises(SystemExit) as done:
        cli.main(argv + ["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for phrase in phrases:
        assert phrase in out, f"{' '.join(argv) or 'mqa-bwd'} --help does not mention {phrase!r}"


@pytest.mark.parametrize("argv, option", [
    (["fuzz", "--heads", "0-4"], "--heads"),
    (["fuzz", "--heads", "9-2"], "--heads"),
    (["fuzz", "--heads", "1-129"], "--heads"),
    (["fuzz", "--heads", "many"], "--heads"),
    (["fuzz", "--minutes", "-1"], "--minutes"),
    (["fuzz", "--workers", "0"], "--workers"),
    (["check", "--backend", "cuda"], "--backend"),
    (["repro", "x.json", "--runs", "0"], "--runs"),
    (["repro", "x.json", "--block-h", "8"], "--block-h"),
    (["bench", "--indices", "zipf"], "--indices"),
    (["bench", "--indices", ","], "--indices"),
])
def test_bad_arguments_are_usage_errors_naming_the_option(capsys, argv, option):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_index_patterns_are_parsed_in_order_each_once():
    assert cli.parse_index_patterns("indexer, uniform,indexer") == ("indexer", "uniform")


def test_parse_heads_accepts_a_range_or_one_count():
    assert cli.parse_heads("1-64") == (1, 64)
    assert cli.parse_heads("8") == (8, 8)
    assert cli.parse_heads("128") == (128, 128)


def test_check_names_a_missing_suite(capsys, tmp_path):
    assert cli.main(["check", "--backend", "model", "--tests", str(tmp_path / "none.py")]) == 2
    assert "--tests" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# bench (CPU side: planning, counting, reporting; the timing needs the H200)
# ---------------------------------------------------------------------------


def test_bench_refuses_cleanly_without_a_gpu(capsys):
    if backends.hopper_available():
        pytest.skip("this machine has a Hopper GPU: bench runs here")
    assert cli.main(["bench", "--shapes", "fleet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mqa-bwd bench: error:") and "Hopper GPU" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--shape", "B=1,S=64,S_kv=64,H=8"], "--shape: missing L"),
    (["--shape", "B=1,S=64,S_kv=64,H=8,L=0"], "--shape: L must be >= 1"),
    (["--shape", "B=1,S=x,S_kv=64,H=8,L=2"], "--shape: S must be an integer"),
    (["--shapes", "dsv4"], "--shapes: unknown shape set 'dsv4'"),
    (["--sweep", "S=1,2"], "--sweep: expected H="),
    (["--backends", "model"], "--backends: 'model' is not a GPU backend"),
    (["--shapes", "fleet", "--plot", "x.png"], "--plot: the rows differ in neither H nor L"),
])
def test_bench_argument_errors_come_before_any_gpu_work(capsys, argv, message):
    if message.startswith("--plot") and importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib (the 'plot' extra) is not installed")
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_plans_named_given_and_swept_shapes():
    assert bench.plan() == bench.SHAPES["dsv32"]
    assert [s["H"] for s in bench.plan(["dsv32"])] == [64, 128]
    swept = bench.plan(["fleet"], [bench.parse_shape("B=2,S=8,S_kv=16,H=4,L=32")], bench.parse_sweep("H=8,16"))
    assert swept == [dict(B=1, S=8192, S_kv=8192, H=8, L=640), dict(B=1, S=8192, S_kv=8192, H=16, L=640),
                     dict(B=2, S=8, S_kv=16, H=8, L=32), dict(B=2, S=8, S_kv=16, H=16, L=32)]
    assert bench.plan(["fleet", "fleet"]) == bench.SHAPES["fleet"]  # duplicates measured once
    assert [(s["S"], s["S_kv"], s["L"]) for s in bench.plan(["causal"])] == [(4096, 4096, 2048)]  # issue 30's first shape


def test_bench_flop_count_reproduces_the_specs_reference_points():
    # docs/SPEC.md: TileLang's public atomic backward, H=64 15.6 ms = 189 TFLOP/s, H=128 30.7 ms = 193 TFLOP/s.
    assert bench.flops(1, 4096, 64, 2048, 576, 512) / 15.6e-3 / 1e12 == pytest.approx(189, abs=1)
    assert bench.flops(1, 4096, 128, 2048, 576, 512) / 30.7e-3 / 1e12 == pytest.approx(193, abs=1)


def _rows():
    make = lambda H, backend, ms, agree=None: bench.Row(1, 64, 128, H, 32, 576, 512, backend, ms, 1.0, 0.5,
                                                        rel_l2_vs_first=agree)
    return bench.with_ratios([make(16, "tilelang", 2.0), make(16, "tilelang-atomic", 4.0, 1e-3),
                              make(32, "tilelang", 3.0), make(32, "tilelang-atomic", 2.0, 0.5)])


def test_bench_table_and_json_carry_the_ratio_and_flag_disagreement():
    rows = _rows()
    assert [r.det_over_atomic for r in rows] == [0.5, None, 1.5, None]
    lines = bench.table(rows).splitlines()
    assert "det/atomic" in lines[0] and "0.50" in lines[1] and "1.50" in lines[3]
    assert "DISAGREE" in lines[4] and "DISAGREE" not in lines[2]
    data = json.loads(bench.to_json(rows, {"device": "test"}))
    assert data["environment"] == {"device": "test"} and data["rows"][2]["det_over_atomic"] == 1.5


def test_bench_shows_an_earlier_jsons_kernel_traces_without_a_gpu(tmp_path, capsys):
    # Rows measured with --trace keep their kernels in the JSON; --from-json prints them under
    # the table, and nothing where no row has a trace.
    traced = _rows()
    traced[0].kernels = [["main_bwd_kernel", 1.75, 1.0], ["delta_kernel", 0.25, 1.0]]
    path = tmp_path / "bench.json"
    path.write_text(bench.to_json(traced))
    assert cli.main(["bench", "--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "== B=1,S=64,S_kv=128,H=16,L=32 uniform, tilelang: 2.000 ms of GPU kernels a call, 2 launches" in out
    assert out.count("== ") == 1 and "delta_kernel" in out
    path.write_text(bench.to_json(_rows()))
    assert cli.main(["bench", "--from-json", str(path)]) == 0
    assert "GPU kernels" not in capsys.readouterr().out


def test_bench_plots_the_rows_of_an_earlier_json_without_a_gpu(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the 'plot' extra (matplotlib) is not installed")
    rows = tmp_path / "bench.json"
    rows.write_text(bench.to_json(_rows()))
    path = tmp_path / "t.png"
    assert cli.main(["bench", "--from-json", str(rows), "--plot", str(path)]) == 0
    assert "plot of ms against H" in capsys.readouterr().err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="neither H nor L"):
        bench.plot(_rows()[:2], tmp_path / "u.png")
    rows.write_text("{}")
    assert cli.main(["bench", "--from-json", str(rows)]) == 2
    assert "--from-json" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# fuzz plumbing: GPU pinning, crash records
# ---------------------------------------------------------------------------


def test_workers_are_pinned_one_per_gpu():
    assert fuzz.worker_specs(2, 2) == ["popen//env:CUDA_VISIBLE_DEVICES=0", "popen//env:CUDA_VISIBLE_DEVICES=1"]
    assert fuzz.worker_specs(3, 2)[2] == "popen//env:CUDA_VISIBLE_DEVICES=0"
    assert fuzz.worker_specs(1, 1) == ["popen//env:CUDA_VISIBLE_DEVICES=0"]
    assert fuzz.worker_specs(2, 0) == ["popen", "popen"]
    command = fuzz.build_pytest_command("t.py", profile="fuzz", summary_json="s.json", failures_dir="f",
                                        heads=(1, 64), workers=2, gpus=2, xdist=True)
    assert command[command.index("--mqa-profile") + 1] == "fuzz" and "1-64" in command
    assert [command[i + 1] for i, word in enumerate(command) if word == "--tx"] == fuzz.worker_specs(2, 2)
    single = fuzz.build_pytest_command("t.py", profile="ci", summary_json="s.json")
    assert "--tx" not in single and "no:xdist" in single and "--failures-dir" not in single


def test_records_of_dead_processes_become_crash_records(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"inflight-gw0-{dead.pid}.safetensors").write_bytes(b"x")
    (tmp_path / f"inflight-gw1-{os.getpid()}.safetensors").write_bytes(b"x")  # alive: still running its call
    found = fuzz.harvest_records(tmp_path, final=False)
    assert [p.name for p in found] == [f"crash-gw0-{dead.pid}.safetensors"]
    assert (tmp_path / f"inflight-gw1-{os.getpid()}.safetensors").exists()
    stalled = fuzz.harvest_records(tmp_path, final=True, stalled=True)
    assert [p.name for p in stalled] == [f"stalled-gw1-{os.getpid()}.safetensors"]


def test_a_fatal_device_error_keeps_the_record_and_ends_the_worker(stub, tmp_path):
    script = textwrap.dedent("""
        from mqa_bwd import fuzz
        from properties.case import Case, to_framework
        t = to_framework(Case(H=3).inputs())
        fuzz.guarded(*[t[k] for k in fuzz._SPEC_ARGS], backend="model")
    """)
    env = dict(os.environ, MQA_FUZZ_TARGET="stub_impls:device_fault", MQA_FUZZ_RECORDS=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(stub), str(ROOT)]))
    env.pop("PYTEST_XDIST_WORKER", None)  # the child is a main process, not this xdist worker
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert done.returncode == 70, done.stderr.decode()[-2000:]
    assert b"fatal device error, inputs saved" in done.stderr
    (record,) = tmp_path.glob("crash-main-*.safetensors")
    loaded = capture.load(record)
    assert loaded.inputs["query"].shape[2] == 3 and loaded.meta["impl"] == "stub_impls:device_fault"


def test_a_call_that_returns_leaves_no_record(tmp_path, monkeypatch):
    from properties.case import Case, to_framework

    monkeypatch.setenv(fuzz.ENV_RECORDS, str(tmp_path))
    monkeypatch.setenv(fuzz.ENV_TARGET, "model")
    t = to_framework(Case(H=2).inputs())
    dq, dkv, dsink = fuzz.guarded(*[t[k] for k in fuzz._SPEC_ARGS])
    assert dq.shape[2] == 2 and list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="query"):  # a rejected call: its exception, and no record left
        fuzz.guarded(t["query"].float(), *[t[k] for k in fuzz._SPEC_ARGS[1:]])
    assert list(tmp_path.iterdir()) == []


def test_failure_files_found_while_fuzzing_name_the_real_target(tmp_path):
    path = tmp_path / "agreement-1.json"
    path.write_text(json.dumps({"case": {}, "property": "agreement", "backend": "model", "impl": fuzz.GUARD,
                                "report": f"FAILS for {fuzz.GUARD}\nREPRO: pytest --impl {fuzz.GUARD}"}))
    assert fuzz.name_real_target(path, "model")
    record = json.loads(path.read_text())
    assert record["impl"] == "mqa_bwd:mqa_latent_sparse_bwd" and fuzz.GUARD not in record["report"]
    assert not fuzz.name_real_target(path, "model")  # already named: unchanged


# ---------------------------------------------------------------------------
# check and fuzz, end to end on the stand-in suite
# ---------------------------------------------------------------------------


def test_check_on_the_model_holds_and_prints_the_table(in_stub, capsys):
    code = cli.main(["check", "--backend", "model", "--tests", str(in_stub / "test_properties.py"), *NO_PLUGIN])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "HOLDS: 2 of 2 properties passed" in out
    for name in ("oracle", "determinism"):
        assert any(line.split("│")[1].strip() == name and "pass" in line for line in out.splitlines()
                   if line.count("│") >= 4), f"no passing row for {name} in\n{out}"


def test_check_fails_on_a_wrong_implementation_and_saves_a_replayable_case(in_stub, tmp_path, capsys):
    failures = tmp_path / "failures"
    code = cli.main(["check", "--backend", "model", "--impl", "stub_impls:wrong", "--failures-dir", str(failures),
                     "--tests", str(in_stub / "test_properties.py"), *NO_PLUGIN])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "DOES NOT HOLD: 1 of 2 properties passed" in out and "REPRO:" in out and "dq: MISMATCH" in out
    saved = failures / "oracle.json"
    assert f"replay: mqa-bwd repro {saved}" in out
    assert cli.main(["repro", str(saved), "--runs", "2"]) == 1  # replays on stub_impls:wrong, as recorded
    assert "outside the oracle tolerance" in capsys.readouterr().out


def test_check_names_only_logs_that_exist_and_leaves_none_in_the_temp_folder(in_stub, tmp_path, capsys, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the run's scratch goes
    (tmp_path / "tmp").mkdir()
    failures = tmp_path / "failures"
    argv = ["check", "--backend", "model", "--failures-dir", str(failures), "--tests",
            str(in_stub / "test_properties.py"), "-k", "oracle", *NO_PLUGIN]
    assert cli.main(argv[:1] + ["--impl", "stub_impls:chatty_wrong"] + argv[1:]) == 1
    out = capsys.readouterr().out
    assert "more lines in " in out, out[-3000:]  # the report was cut: the rest is in the log it names
    named = set(re.findall(r"(/\S+?\.log)\b", out))
    assert named and all(Path(p).is_file() for p in named), named
    assert list((tmp_path / "tmp").iterdir()) == []
    (log,) = named
    assert "chatter 299" in Path(log).read_text()
    # A run that holds leaves no log anywhere; one that fails again replaces the log, so they do not pile up.
    assert cli.main(argv) == 0
    assert ".log" not in capsys.readouterr().out and list((tmp_path / "tmp").iterdir()) == []
    assert cli.main(argv[:1] + ["--impl", "stub_impls:wrong"] + argv[1:]) == 1
    assert set(re.findall(r"(/\S+?\.log)\b", capsys.readouterr().out)) == named
    assert [p for p in tmp_path.rglob("*.log")] == [Path(log)] and "chatter" not in Path(log).read_text()


def test_fuzz_on_the_model_with_one_worker_runs_cases_and_finds_nothing(in_stub, tmp_path, capsys):
    code = cli.main(["fuzz", "--backend", "model", "--minutes", "0.1", "--workers", "1",
                     "--failures-dir", str(tmp_path / "f"), "--tests", str(in_stub / "test_properties.py"), *NO_PLUGIN])
    out = capsys.readouterr().out
    assert code == 0, out
    total = int(out.split("no failure: ")[1].split(" cases")[0])
    assert total >= 2, out
    assert out.count("no failure (time slice used up)") + out.count("no failure (all examples ran)") == 2


def test_fuzz_keeps_the_case_of_a_crashed_worker_for_repro(in_stub, tmp_path, capsys):
    failures = tmp_path / "f"
    code = cli.main(["fuzz", "--impl", "stub_impls:crashy", "--backend", "model", "--heads", "3-3", "-k", "oracle",
                     "--minutes", "0.05", "--workers", "1", "--failures-dir", str(failures),
                     "--tests", str(in_stub / "test_properties.py"), *NO_PLUGIN])
    out = capsys.readouterr().out
    assert code == 1, out
    records = sorted(failures.glob("crash-gw*.safetensors"))
    assert records, out
    assert "crashed" in out and f"replay: mqa-bwd repro {records[0]}" in out
    loaded = capture.load(records[0])
    assert loaded.inputs["query"].shape[2] == 3
    assert loaded.meta["impl"] == "stub_impls:crashy" and "test_property_" in loaded.meta["property"]
    assert not list(failures.glob("inflight-*"))
    # Replayed on the model rather than on the crashing function, the same inputs are fine.
    assert cli.main(["repro", str(records[0]), "--backend", "model", "--impl", "mqa_bwd:mqa_latent_sparse_bwd",
                     "--runs", "2"]) == 0


def test_check_fails_when_the_implementation_kills_pytest(in_stub, tmp_path, capsys):
    # A crash is a finding, not a run that could not start: exit 1, as for any failing property.
    code = cli.main(["check", "--impl", "stub_impls:crashy", "--backend", "model", "--heads", "3-3", "-k", "oracle",
                     "--failures-dir", str(tmp_path / "f"), "--tests", str(in_stub / "test_properties.py"), *NO_PLUGIN])
    out = capsys.readouterr().out
    assert code == 1, out[-3000:]
    assert "DOES NOT HOLD: pytest ended abnormally (exit code -9" in out, out[-3000:]


def _children(pid: int) -> list:
    """The pids whose parent is ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_stopping_the_suite_ends_a_worker_that_outlives_pytest():
    # A worker deaf to SIGINT (stuck in a native call) outlives its controller, which does not.
    worker = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(300)"
    leader = (f"import subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', {worker!r}], "
              "stdout=subprocess.PIPE); w.stdout.readline(); print('ready', flush=True); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", leader], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        fuzz._stop(proc, patience_s=5.0)
        for _ in range(50):  # SIGKILL is asynchronous: the worker may take a moment to go
            if not _group_alive(proc.pid):
                break
            time.sleep(0.1)
        assert not _group_alive(proc.pid)
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_check_stopped_by_a_signal_stops_its_pytest_and_could_not_finish(stub, signum):
    # What 'timeout' does in CI (SIGTERM), or Ctrl-C: the pytest child runs in its own process
    # group, so check must end that group itself rather than leave it running, orphaned.
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs Linux /proc to find the child process")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub), str(ROOT)]))
    command = [sys.executable, "-m", "mqa_bwd", "check", "--backend", "model", "--profile", "fuzz",
               "--tests", str(stub / "test_properties.py"), *NO_PLUGIN]
    # SIGINT at its default even where this run ignores it (a background job): check honours an ignored one.
    parent = subprocess.Popen(command, cwd=stub, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    children = []
    try:
        for _ in range(600):  # the fuzz profile's 100000 examples keep pytest busy long after this
            children = _children(parent.pid)
            if children or parent.poll() is not None:
                break
            time.sleep(0.1)
        assert children, parent.communicate(timeout=60)[0].decode()[-3000:]
        time.sleep(2.0)  # let pytest start its tests
        parent.send_signal(signum)
        out = parent.communicate(timeout=120)[0].decode()
        assert parent.returncode == 2 and "DID NOT FINISH: " in out, out[-3000:]  # nothing had failed
        assert not [pid for pid in children if _group_alive(pid)], out[-3000:]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in children:  # its own group (start_new_session): ours to end if it survived
            if _group_alive(pid):
                os.killpg(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------
# The real property suite
# ---------------------------------------------------------------------------


def _first_property() -> str:
    import re

    names = re.findall(r"def test_property_(\w+)", REAL_SUITE.read_text())
    return "output_contract" if "output_contract" in names else names[0]


@pytest.mark.parametrize("failed_before", [False, True])
def test_check_stopped_by_a_signal_judges_only_what_failed_before_it(tmp_path, monkeypatch, capsys, failed_before):
    # pytest's KeyboardInterrupt handling can itself fail inside pytest (a traceback entry without a
    # line number on Python 3.11) and exit 1 after the signal: that is no failing property.
    progress = {}
    if failed_before:
        progress["t::test_property_oracle"] = fuzz.TestProgress("t::test_property_oracle", cases=3, failed_cases=1,
                                                                outcome="failed")

    def interrupted(command, *, log_path, **kwargs):
        Path(log_path).write_text("TypeError: unsupported operand type(s) for -: 'NoneType' and 'int'\n")
        return fuzz.SuiteRun(list(command), 1, Path(log_path), progress, None, "interrupted by the user", [], 2.7, True)

    monkeypatch.setattr(fuzz, "run_suite", interrupted)
    suite = tmp_path / "test_properties.py"
    suite.write_text("")  # check refuses a suite that is not there; run_suite never reads it here
    code = cli.main(["check", "--backend", "model", "--failures-dir", str(tmp_path / "f"), "--tests", str(suite)])
    out = capsys.readouterr().out
    if failed_before:
        assert code == 1 and "DOES NOT HOLD: interrupted by the user" in out, out
    else:
        assert code == 2 and "DID NOT FINISH: interrupted by the user" in out, out


def test_a_property_a_signal_stops_while_it_runs_reads_stopped_with_its_cases(tmp_path):
    # pytest reports a test interrupted in its call as nothing at all: the table and the summary
    # JSON read "stopped" (not a skip of 0 cases) with the cases its progress counted.
    if _real_suite_missing():
        pytest.skip(_real_suite_missing())
    summary = tmp_path / "summary.json"
    command = [sys.executable, "-m", "mqa_bwd", "check", "--backend", "model", "-k",
               "determinism and not process and not scale", "--failures-dir", str(tmp_path / "f"),
               "--summary-json", str(summary)]
    parent = subprocess.Popen(command, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in parent.stdout:  # the progress line, once the property has run cases
            seen.append(line)
            if re.search(r"\.\.\. [1-9]\d* cases so far; running: determinism", line):
                break
        parent.send_signal(signal.SIGTERM)
        out = "".join(seen) + parent.communicate(timeout=120)[0]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert parent.returncode == 2 and "DID NOT FINISH: stopped by SIGTERM" in out, out[-3000:]
    row = re.search(r"^│ determinism +│ stopped +│ +(\d+) │", out, re.M)
    assert row and int(row.group(1)) > 0, out[-3000:]
    result = json.loads(summary.read_text())["properties"]["determinism"]
    assert result["verdict"] == "stopped" and result["cases"] == int(row.group(1)), result


def test_check_on_the_real_suite_with_a_small_budget(capsys, tmp_path):
    if _real_suite_missing():
        pytest.skip(_real_suite_missing())
    name = _first_property()
    code = cli.main(["check", "--backend", "model", "--profile", "dev", "-k", name, "--heads", "1-4",
                     "--failures-dir", str(tmp_path), "--summary-json", str(tmp_path / "summary.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["properties"][name]["verdict"] == "pass" and summary["properties"][name]["cases"] > 0
    # The README's account of the summary JSON names every key the run wrote.
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    keys = set(summary) | set(summary["properties"][name]) | set(summary["domain"])
    assert all(f"`{key}`" in readme for key in keys), sorted(k for k in keys if f"`{k}`" not in readme)


@pytest.mark.parametrize("argv, why", [
    (["-k", "determinism_at_scale"], "every property was skipped: runs on a GPU backend only"),  # the model: CPU
    (["--domain", "heads=2-8", "--heads", "16-32"], "the property suite refused its arguments"),  # pytest: 4
    (["-k", "nosuchprop"], "no property was selected"),  # pytest: 5
])
def test_check_that_runs_no_property_could_not_run(capsys, tmp_path, argv, why):
    # Exit code 2, as for any command that could not do its job; 1 is kept for a property that fails.
    if _real_suite_missing():
        pytest.skip(_real_suite_missing())
    code = cli.main(["check", "--backend", "model", "--failures-dir", str(tmp_path), *argv])
    out = capsys.readouterr().out
    assert code == 2, out
    assert out.rstrip().splitlines()[-1].startswith(f"COULD NOT RUN: {why}"), out


def test_the_summary_json_says_why_a_property_was_skipped(capsys, tmp_path):
    if _real_suite_missing():
        pytest.skip(_real_suite_missing())
    summary = tmp_path / "summary.json"
    cli.main(["check", "--backend", "model", "-k", "determinism_at_scale", "--failures-dir", str(tmp_path),
              "--summary-json", str(summary)])
    result = json.loads(summary.read_text())["properties"]["determinism_at_scale"]
    assert result["verdict"] == "skip" and result["skip_reason"].startswith("runs on a GPU backend only"), result
    assert f"skip ({result['skip_reason']})" in capsys.readouterr().out  # what the table shows


def test_check_counts_a_failing_propertys_cases_alike_in_the_progress_line_and_the_table(capsys, tmp_path):
    # Shrinking the failure reruns the property many times: neither count may include those reruns.
    if _real_suite_missing():
        pytest.skip(_real_suite_missing())
    summary = tmp_path / "summary.json"
    code = cli.main(["check", "--backend", "model", "--impl", "mqa_bwd.mutants:pad_dq_unsliced", "-k",
                     "output_contract", "--failures-dir", str(tmp_path), "--summary-json", str(summary)])
    out = capsys.readouterr().out
    assert code == 1, out
    progress = int(re.search(r"^  output_contract: failed, (\d+) cases", out, re.M).group(1))
    table = int(re.search(r"^│ output_contract +│ fail +│ +(\d+) │", out, re.M).group(1))
    assert progress == table == json.loads(summary.read_text())["properties"]["output_contract"]["cases"], out


def test_a_failed_propertys_whole_report_is_saved_beside_its_case(capsys, tmp_path):
    # pytest prints a failure's report only when the session ends, so a run stopped after a failure
    # (a CI timeout) would lose it: the plugin writes it to reports/NAME.txt as the test ends.
    if _real_suite_missing():
        pytest.skip(_real_suite_missing())
    code = cli.main(["check", "--backend", "model", "--impl", "mqa_bwd.mutants:pad_dq_unsliced", "-k",
                     "output_contract", "--failures-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1, out
    text = (tmp_path / "reports" / "output_contract.txt").read_text()
    assert "property output_contract FAILS" in text and "REPRO:" in text, text[-2000:]
    # The test ended: its whole report replaced the first failing case's.
    assert not text.startswith(plugin.FIRST_FAILURE_HEADER), text[:2000]


def test_a_propertys_first_failing_case_is_saved_before_its_test_ends(tmp_path):
    # Hypothesis shrinks a failure before the test ends, and on a GPU that can outlast a CI job:
    # the first failing case's report and REPRO line are on disk as soon as it fails.
    harness = plugin._build("mqa_bwd.mutants:pad_dq_unsliced", "model", plugin.DEFAULT_REPEATS, None, "ci", None,
                            tmp_path)
    case = Case(H=3, S=2, L=8, seed=4)
    with pytest.raises(plugin.PropertyFailure):
        harness.check("output_contract", case)
    text = (tmp_path / "reports" / "output_contract.txt").read_text()
    assert text.startswith(plugin.FIRST_FAILURE_HEADER + "\n"), text[:2000]
    assert "property output_contract FAILS" in text and f"--replay {shlex.quote(case.to_json())}" in text, text


def test_fuzz_on_the_real_suite_for_a_few_seconds(capsys, tmp_path):
    if _real_suite_missing():
        pytest.skip(_real_suite_missing())
    name = _first_property()
    code = cli.main(["fuzz", "--backend", "model", "--minutes", "0.05", "--workers", "1", "--heads", "1-4",
                     "-k", name, "--failures-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert int(out.split("no failure: ")[1].split(" cases")[0]) > 0


def test_fuzz_counts_each_memory_safety_check_and_its_hits(capsys, tmp_path, monkeypatch):
    # The bad implementation flushes a denormal canary on every call: the count line says which check
    # failed and how often, the other checks show 0 failed.
    if _real_suite_missing():
        pytest.skip(_real_suite_missing())
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(ROOT / "tests"), os.environ.get("PYTHONPATH")))))
    code = cli.main(["fuzz", "--backend", "model", "--minutes", "0.05", "--workers", "1", "--heads", "1-4",
                     "--impl", "test_guards:adds_zero_before_its_accumulator", "-k", "memory_safety",
                     "--failures-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1, out
    line = next(l for l in out.splitlines() if l.startswith("memory_safety checks: "))
    counts = dict((k.strip(), (int(f), int(n))) for k, f, n in re.findall(r"([a-z ]+) (\d+) failed of (\d+)", line[22:]))
    assert counts["denormal canary"][0] > 0 and counts["guard bands"][0] == 0 and counts["read bands"][0] == 0, line
    assert counts["guard bands"][1] >= counts["denormal canary"][0] and counts["inputs untouched"][0] == 0, line


def test_sub_check_counts_add_up_over_rounds_and_the_inputs_checks_count_as_one():
    from properties.plugin import add_finding_counts

    rounds = [{"guard bands": {"held": 3, "failed": 0}, "input query untouched": {"held": 2, "failed": 1}},
              {"guard bands": {"held": 1, "failed": 2}, "input kv untouched": {"held": 4}}]  # a count may be absent
    total = {}
    for counts in rounds:
        assert add_finding_counts(total, counts) is total
    assert total == {"guard bands": {"held": 4, "failed": 2}, "input query untouched": {"held": 2, "failed": 1},
                     "input kv untouched": {"held": 4, "failed": 0}}
    assert cli.findings_lines({"memory_safety": total}) == [
        "memory_safety checks: guard bands 2 failed of 6, inputs untouched 1 failed of 7"]
    # A property with no sub-check counts (one that never ran, or whose verdicts have none) gets no line.
    assert cli.findings_lines({"determinism_at_scale": {}, "memory_safety": total}) == \
        cli.findings_lines({"memory_safety": total})


def test_promote_makes_a_failure_a_replayed_regression(tmp_path, capsys):
    from properties.case import Case
    from properties.plugin import regression_cases

    case = Case(H=3, seed=7)
    failure = tmp_path / "determinism-x.json"
    failure.write_text(json.dumps({"case": case.to_dict(), "property": "determinism", "backend": "model",
                                   "report": "dkv: run 1 differs"}))
    regressions = tmp_path / "regressions"
    regressions.mkdir()
    assert cli.main(["promote", str(failure), "--regressions-dir", str(regressions)]) == 0
    (saved,) = regressions.iterdir()
    assert saved.name.startswith("determinism-") and str(saved) in capsys.readouterr().out
    assert regression_cases("determinism", regressions) == [case]
    assert regression_cases("agreement", regressions) == []  # kept for its own property only
    assert json.loads(saved.read_text())["report"] == "dkv: run 1 differs"


def test_promote_creates_a_regressions_folder_but_refuses_a_file(tmp_path, capsys):
    failure = tmp_path / "agreement-x.json"
    failure.write_text(json.dumps({"case": {"H": 2}, "property": "agreement"}))
    regressions = tmp_path / "new" / "regressions"
    assert cli.main(["promote", str(failure), "--regressions-dir", str(regressions)]) == 0
    assert [p.name for p in regressions.iterdir()] == [p.name for p in regressions.glob("agreement-*.json")] != []
    capsys.readouterr()
    assert cli.main(["promote", str(failure), "--regressions-dir", str(failure)]) == 2
    assert "--regressions-dir" in capsys.readouterr().err and json.loads(failure.read_text())["property"] == "agreement"


def test_promote_refuses_what_is_not_a_case(tmp_path, capsys):
    junk = tmp_path / "junk.json"
    junk.write_text('{"nothing": 1}')
    assert cli.main(["promote", str(junk), "--regressions-dir", str(tmp_path)]) == 2
    assert "FILE:" in capsys.readouterr().err
    good = tmp_path / "case.json"
    good.write_text(json.dumps({"case": {"H": 2}, "property": "agreement"}))
    assert cli.main(["promote", str(good), "--property", "nonsense", "--regressions-dir", str(tmp_path)]) == 2
    assert "--property" in capsys.readouterr().err


def test_a_fuzz_run_keeps_its_own_round_logs_and_the_cases_saved_before(tmp_path, monkeypatch, capsys):
    failures = tmp_path / "fuzz-failures"
    (failures / "logs").mkdir(parents=True)
    (failures / "logs" / "round1.log").write_text("an earlier run's round\n")
    (failures / "logs" / "round7.log").write_text("an earlier run's round\n")
    earlier_case = failures / "agreement-earlier.json"
    earlier_case.write_text("{}")
    rounds = []

    def one_round(command, *, log_path, **kwargs):  # a round stopped at once, as by a signal
        rounds.append(log_path)
        Path(log_path).write_text("this run's round\n")
        return fuzz.SuiteRun(list(command), 2, Path(log_path), {}, None, "stopped by SIGTERM", [], 0.0, True)

    monkeypatch.setattr(fuzz, "run_suite", one_round)
    # Stopped by a signal with nothing found: it could not finish its run, which is no pass.
    assert cli.main(["fuzz", "--backend", "model", "--minutes", "1", "--failures-dir", str(failures)]) == 2
    assert "DID NOT FINISH: stopped by SIGTERM" in capsys.readouterr().out
    assert rounds == [failures.resolve() / "logs" / "round1.log"]
    assert [p.name for p in (failures / "logs").iterdir()] == ["round1.log"]
    assert (failures / "logs" / "round1.log").read_text() == "this run's round\n"
    assert earlier_case.exists()
