"""The gate runs where it is installed: a wheel, a fresh virtualenv, an empty directory.

Marked ``wheel`` (outside the default run: it builds and installs, minutes);
``.ci/run`` runs it after ``make test``. torch is installed into the new
environment first, as a user without a GPU would install the CPU build
(``MQA_TORCH_SPEC``, default the Makefile's pin, from ``MQA_TORCH_INDEX`` where
pip's own indexes lack it), so that the wheel's own
``torch`` requirement is already met and pip takes no CUDA build.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.wheel

ROOT = Path(__file__).resolve().parents[1]
TORCH_SPEC = os.environ.get("MQA_TORCH_SPEC", "torch==2.13.0+cpu")
TORCH_INDEX = os.environ.get("MQA_TORCH_INDEX", "")

USER_PACKAGE = '''
"""A user's implementations: ours behind a plain SPEC signature (no instruments seam), and a broken one."""
import mqa_bwd


def bwd(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale, *, block_h=None,
        dkv_buf_bytes=None, backend=None):
    return mqa_bwd.mqa_latent_sparse_bwd(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale,
                                         block_h=block_h, dkv_buf_bytes=dkv_buf_bytes, backend=backend)


def bwd_d_sink_float64(*args, **kwargs):
    dq, dkv, d_sink = bwd(*args, **kwargs)
    return dq, dkv, d_sink.double()
'''


def _run(command, cwd, env, timeout=1500):
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(bin folder, environment) of a fresh virtualenv with the wheel built from this checkout."""
    work = tmp_path_factory.mktemp("wheel")
    code, out = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"), str(ROOT)],
                     work, dict(os.environ))
    assert code == 0, out[-3000:]
    (wheel,) = (work / "dist").glob("mqa_bwd-*.whl")
    venv = work / "venv"
    code, out = _run([sys.executable, "-m", "venv", str(venv)], work, dict(os.environ))
    assert code == 0, out[-3000:]
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    code, out = _run(pip + [TORCH_SPEC], work, env)
    if code != 0 and TORCH_INDEX:  # the CPU build is not on pip's indexes here: the Makefile's fallback
        code, out = _run(pip + ["--extra-index-url", TORCH_INDEX, TORCH_SPEC], work, env)
    assert code == 0, out[-3000:]
    code, out = _run(pip + [str(wheel)], work, env)
    assert code == 0, out[-3000:]
    user = work / "user"
    (user / "somepkg").mkdir(parents=True)
    (user / "somepkg" / "__init__.py").write_text(textwrap.dedent(USER_PACKAGE))
    env = dict(env, PYTHONPATH=str(user), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    return venv / "bin", env


@pytest.fixture
def empty(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def test_the_installed_package_is_the_wheel_not_this_checkout(installed, empty):
    bin_dir, env = installed
    code, out = _run([str(bin_dir / "python"), "-c", "import mqa_bwd, properties; print(mqa_bwd.__file__, properties.__file__)"],
                     empty, env)
    assert code == 0, out
    assert str(ROOT) not in out and "site-packages" in out, out


def test_check_holds_on_the_model(installed, empty):
    bin_dir, env = installed
    code, out = _run([str(bin_dir / "mqa-bwd"), "check", "--backend", "model", "--workers", "2"], empty, env)
    assert code == 0, out[-5000:]
    assert re.search(r"HOLDS: (\d+) of \1 properties passed, 1 skipped", out), out[-5000:]
    assert not (empty / ".mqa-failures").exists() or not any((empty / ".mqa-failures").iterdir())


def test_check_runs_against_a_users_function(installed, empty):
    bin_dir, env = installed
    code, out = _run([str(bin_dir / "mqa-bwd"), "check", "--impl", "somepkg:bwd", "--backend", "model",
                      "--workers", "2"], empty, env)
    assert code == 0, out[-5000:]
    assert re.search(r"HOLDS: (\d+) of \1 properties passed, 1 skipped", out), out[-5000:]


def test_a_users_failure_is_saved_in_the_working_directory_and_promotable(installed, empty, tmp_path):
    bin_dir, env = installed
    code, out = _run([str(bin_dir / "mqa-bwd"), "check", "--impl", "somepkg:bwd_d_sink_float64", "--backend",
                      "model", "--profile", "dev", "-k", "output_contract"], empty, env)
    assert code == 1, out[-5000:]
    (saved,) = (empty / ".mqa-failures").glob("output_contract-*.json")
    assert f"replay: mqa-bwd repro {saved}" in out
    regressions = tmp_path / "regressions"
    regressions.mkdir()
    code, out = _run([str(bin_dir / "mqa-bwd"), "promote", str(saved), "--regressions-dir", str(regressions)], empty, env)
    assert code == 0, out
    assert [p.name for p in regressions.iterdir()] == [saved.name]


def test_pytest_pyargs_runs_the_installed_suite(installed, empty):
    bin_dir, env = installed
    code, out = _run([str(bin_dir / "python"), "-m", "pytest", "--pyargs", "properties", "-q", "-p", "no:cacheprovider",
                      "--backend", "model", "--mqa-profile", "dev", "-k", "output_contract or rejection"], empty, env)
    assert code == 0, out[-5000:]
    assert "2 passed" in out, out[-3000:]
