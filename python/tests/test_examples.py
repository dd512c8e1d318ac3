"""The examples run (each in a process of its own, bounded in time)."""

import json
import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout


def test_echo_example():
    out = run(str(EXAMPLES / "echo.py"))
    assert "echoed 16777152 bytes" in out and "echoed an active message" in out


def test_pingpong_example():
    line = run(
        str(EXAMPLES / "pingpong.py"), "--iters", "200", "--warmup", "20",
        "--rate-msgs", "2000", "--json",
    )
    res = json.loads(line.strip().splitlines()[-1])
    assert res["iters"] == 200
    assert 0 < res["rtt_p50_us"] <= res["rtt_p99_us"]
    assert res["rate_msgs_per_s"] > 0


def test_readme_quick_start(tmp_path):
    readme = (EXAMPLES.parent / "README.md").read_text()
    code = readme.split("## Quick start\n\n```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    run(str(script))


def test_rpc_call_example():
    out = run(str(EXAMPLES / "rpc_call.py"), "--iters", "100")
    assert "serves shardcx.bench.echo" in out and "callable from Python" in out
    assert "echoed 1048576 bytes" in out and "100 calls of 8 bytes: p50" in out
