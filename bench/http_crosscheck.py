"""Cross-check the bench's HTTP load driver against an external load tool (`wrk`, Debian's package).

    python -m bench.http_crosscheck [--concurrency 1,64] [--seconds 8] [--max-tokens 8]

Starts one collapsed spine with its HTTP API on loopback TCP (wrk speaks no unix sockets),
then, at each concurrency, drives `POST /v1/completions` with distinct greedy prompts (no
response-cache hit) twice back to back: with `bench.http_load` (the driver `make bench`
uses, closed-loop threads, one keep-alive connection each) and with wrk (a Lua script
numbering its prompts). Prints both throughputs and p50s: if they agree, the bench's HTTP
figures are the server's, not its client's.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.http_load import HttpEndpoint
from bench.load import prompts, requests_for, run_batch
from bench.settings import DEV_KEY, RATE_LIMIT_OFF
from bench.targets import REPO_ROOT, keep_load_generator_off, server_cpu
from runtime.processes.launch import launch, spine_up_argv

WRK_SCRIPT = """
counter = 0
request = function()
  counter = counter + 1
  local body = string.format('{"model":"tiny-lm","prompt":"wrk %%s %%08d spine gateway","max_tokens":%d,"temperature":0}',
                             tostring(math.random(1, 1000000000)), counter)
  return wrk.format("POST", "/v1/completions", {["Content-Type"]="application/json",
                    ["Authorization"]="Bearer %s"}, body)
end
"""


def _wrk(address: str, concurrency: int, seconds: float, script: Path) -> tuple[float, float]:
    """(requests/s, p50 ms) from one wrk run."""
    out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{seconds:g}s", "--latency", "-s", str(script),
                          f"http://{address}"], capture_output=True, text=True, check=True).stdout
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise RuntimeError(f"wrk got {errors.group(1)} answers that are not 2xx:\n{out}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    value, unit = re.search(r"50%\s+([\d.]+)(us|ms|s)", out).groups()  # type: ignore[union-attr]
    p50_ms = float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
    return rps, p50_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.http_crosscheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    levels = [int(part) for part in args.concurrency.split(",")]
    run_dir = Path(tempfile.mkdtemp(prefix="spx-"))
    overlay = run_dir / "overlay.yaml"
    overlay.write_text(yaml.safe_dump(RATE_LIMIT_OFF))
    script = run_dir / "wrk.lua"
    script.write_text(WRK_SCRIPT % (args.max_tokens, DEV_KEY))
    launched = launch("collapsed", spine_up_argv(overlay, "collapsed", listen=f"unix:{run_dir}/g.sock",
                                                 http_listen="127.0.0.1:0", run_dir=run_dir / "run"),
                      log_path=run_dir / "collapsed.log", cwd=REPO_ROOT)
    try:
        address = str(launched.wait_ready(120)["http_address"])
        keep_load_generator_off(server_cpu())
        endpoint = HttpEndpoint(address, DEV_KEY)
        run_batch(endpoint, requests_for(prompts("warm", 20), args.max_tokens), concurrency=4, time_limit_s=30)
        print(f"{'conc':>5} {'driver rps':>11} {'wrk rps':>9} {'driver p50 ms':>14} {'wrk p50 ms':>11}")
        for concurrency in levels:
            count = 100_000
            started = time.perf_counter()
            batch = run_batch(endpoint, requests_for(prompts(f"x{concurrency}", count), args.max_tokens),
                              concurrency=concurrency, time_limit_s=args.seconds)
            ok = sorted(call.latency_s for call in batch.calls if call.ok)
            driver_rps = len(ok) / (time.perf_counter() - started)
            driver_p50 = 1000.0 * ok[len(ok) // 2] if ok else float("nan")
            wrk_rps, wrk_p50 = _wrk(address, concurrency, args.seconds, script)
            print(f"{concurrency:>5} {driver_rps:>11.1f} {wrk_rps:>9.1f} {driver_p50:>14.2f} {wrk_p50:>11.2f}")
        endpoint.close()
    finally:
        launched.stop(30)
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
