"""How long ``titan plan`` takes to search a cluster: DeepSeek-V3's shapes (the published
config.json, its FP8 quantisation block ignored) on 256 to 2,048 H100s, 8 a node, four sequences of
4,096 tokens a device, bf16-mixed; one line per size with the seconds it took.

    python -m lightning_titan.tools.plan_speed                  # 256, 1024 and 2048 devices
    python -m lightning_titan.tools.plan_speed --devices 2048 --config path/to/config.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

DEEPSEEK_V3 = Path(__file__).resolve().parents[2] / "tests" / "support" / "fixtures" / "deepseek_v3"


def timed(config: str, devices: int) -> tuple[float, str]:
    """Wall seconds of one ``titan plan`` over ``devices`` H100s in a fresh process (the start of
    Python and torch included; nothing cached from another size), and its first row or why none."""
    args = [sys.executable, "-m", "lightning_titan", "plan", "--config", config, "--devices",
            str(devices), "--device", "h100-80gb", "--global-batch", str(4 * devices),
            "--precision", "bf16-mixed", "--top", "1"]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - start
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 1 |")]
    said = rows or done.stderr.strip().splitlines()[-1:] or [""]
    return seconds, said[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--config", default=str(DEEPSEEK_V3 / "config.json"))
    args = parser.parse_args()
    for devices in args.devices:
        seconds, first = timed(args.config, devices)
        print(f"{devices} devices: {seconds:.1f} s  {first[:160]}", flush=True)


if __name__ == "__main__":
    main()
