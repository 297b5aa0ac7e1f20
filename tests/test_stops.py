"""Stopping a job: Ctrl-C (SIGINT) or SIGTERM ends ``run`` and ``sweep`` with their own words
(``--json``: one object on stdout), the exit status 128 + the signal's number, and no
traceback from the command or its ranks; a sweep prints its table so far."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _stop_after(argv, first_line: str, how: int, watch: str) -> tuple[int, str, str]:
    """Start ``layer-boundary argv``, send ``how`` once ``first_line`` starts a line of its
    ``watch`` stream (stdout or stderr), and return its status, stdout and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "layer_boundary", *argv], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        stream = proc.stdout if watch == "stdout" else proc.stderr
        for line in stream:
            seen.append(line)
            if line.startswith(first_line):
                break
        time.sleep(0.3)
        proc.send_signal(how)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    if watch == "stdout":
        out = "".join(seen) + out
    else:
        err = "".join(seen) + err
    return proc.returncode, out, err


@pytest.mark.timeout(240)
def test_ctrl_c_ends_a_run_with_one_json_object(qwen3_dir):
    """A KeyboardInterrupt traceback and no JSON, from the command and from each rank."""
    code, out, err = _stop_after(["run", "--tp", "2", "--model", str(qwen3_dir), "--json",
                                  "--start-timeout", "600"], "starting 2 rank processes",
                                 signal.SIGINT, "stderr")
    assert code == 128 + signal.SIGINT
    assert json.loads(out) == {"verdict": "STOPPED", "exit_code": 128 + signal.SIGINT,
                               "error": "stopped by SIGINT; every rank it started is stopped"}
    assert "Traceback" not in err, err


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how,as_json", [(signal.SIGTERM, True), (signal.SIGINT, False)],
                         ids=["sigterm-json", "sigint-text"])
def test_a_stopped_sweep_prints_its_table_so_far(qwen3_dir, how, as_json):
    """``sweep --json`` under SIGTERM died by the signal with nothing on stdout."""
    argv = ["sweep", "--model", str(qwen3_dir), "--max-world", "2"] + ["--json"] * as_json
    # the second layout has started: the first is a row of the table
    code, out, err = _stop_after(argv, "  tp2 auto ...", how, "stderr" if as_json else "stdout")
    assert code == 128 + how
    name = signal.Signals(how).name
    if as_json:
        result = json.loads(out)
        assert result["stopped"]["signal"] == name and result["stopped"]["not_started"]
        assert result["verdict"] == "STOPPED"
        assert [r["layout"] for r in result["rows"]][:1] == ["tp1 auto"]
    else:
        assert "\n  tp1 auto " in out
        assert re.search(rf"\nstopped by {name}: (interrupted: [^;]+; )?not started: ", out)
        assert f"\nverdict: STOPPED (by {name} after " in out
    assert "Traceback" not in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_signal_while_torch_loads_is_a_stop_too(how):
    """Ctrl-C in the second or more the command spends importing torch (before it reached
    its handler) was a KeyboardInterrupt traceback, and SIGTERM a death by the signal with
    no JSON. The signal is sent where the command's body starts, before its imports."""
    script = ("import os, sys\n"
              "import layer_boundary.engine.cli as cli\n"
              f"cli.set_level = lambda name: os.kill(os.getpid(), {int(how)})\n"
              "sys.exit(cli.main(['run', '--json']))\n")
    proc = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True,
                          text=True, timeout=50)
    name = signal.Signals(how).name
    assert proc.returncode == 128 + how, (proc.returncode, proc.stderr)
    assert json.loads(proc.stdout) == {"verdict": "STOPPED", "exit_code": 128 + how,
                                       "error": f"stopped by {name}; every rank it started "
                                                "is stopped"}
    assert "Traceback" not in proc.stderr, proc.stderr
