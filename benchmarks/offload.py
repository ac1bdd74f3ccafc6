"""Decode speed with and without ``--offload disk`` under a memory cap, and what the offloading moves.

Builds a random-weight BLOOM (by default about 3.3 GB in float32: 15 layers of hidden size 2048 and a
32,000-token vocabulary, so that the largest layer, brought in whole, fits a 1 GiB cap), saves it with
save_pretrained, then runs ``accelgen bench`` on it exactly as a user would, once as it is and once with
``--offload disk --max-device-memory CAP``, and reads the figures off the result files. Beside tokens/s it
shows the bytes the offloading brought to the device per forward pass against the floor (each offloaded
byte once per pass), and what the runs read from the storage device (``ru_inblock`` of the finished bench
process: zero when the offloaded files stay in the page cache).

    python benchmarks/offload.py                                    # the issue's measurement
    python benchmarks/offload.py --cold                             # page cache dropped first (root)
    python benchmarks/offload.py --layers 4 --hidden 256 --vocab 4096 --cap 8MiB --new-tokens 8   # quick look
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from load_time import drop_page_cache, save_model
from random_bloom import add_shape_arguments, describe_shape

GIB = 2**30


def bench(folder: Path, output: Path, arguments: argparse.Namespace, *offload: str) -> tuple[dict, int]:
    """The result document of one ``accelgen bench`` run, and the bytes it read from the storage device."""
    if arguments.cold:
        drop_page_cache()
    blocks_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "bench", "--device", "cpu", "--model", str(folder),
         "--batch-sizes", arguments.batch_sizes, "--max-new-tokens", str(arguments.new_tokens), "--runs",
         str(arguments.runs), "--warmup-runs", "1", "--output", str(output), *offload],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"accelgen bench failed:\n{result.stderr[-3000:]}")
    read_bytes = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - blocks_before) * 512
    return json.loads(output.read_text()), read_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.set_defaults(layers=15, hidden=2048, heads=16, vocab=32000)
    parser.add_argument("--cap", default="1GiB", help="--max-device-memory of the offloaded runs")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=20)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each bench (root only)")
    arguments = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        folder = scratch / "model"
        save_model(folder, arguments.layers, arguments.hidden, arguments.heads, arguments.vocab)
        size = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
        plain, plain_read = bench(folder, scratch / "plain.json", arguments)
        offloaded, offloaded_read = bench(folder, scratch / "offload.json", arguments, "--offload", "disk",
                                          "--max-device-memory", arguments.cap)

    placement = offloaded["measurements"][0]["offload"]
    print(f"{describe_shape(arguments)}, float32 safetensors of {size / GIB:.2f} GiB, {arguments.new_tokens} new tokens, "
          f"best of {arguments.runs} runs; --offload disk --max-device-memory {arguments.cap}: "
          f"{placement['device_bytes'] / GIB:.2f} GiB of weights kept, {placement['disk_bytes'] / GIB:.2f} GiB offloaded")
    print(f"read from the storage device: {plain_read / GIB:.2f} GiB without offload, {offloaded_read / GIB:.2f} GiB with"
          + (" (page cache dropped first)" if arguments.cold else " (page cache warm)"))
    print("| batch | tokens/s | decode ms/token | tokens/s offloaded | decode ms/token offloaded | slowdown | "
          "moved per pass (GiB) | floor (GiB) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row, offloaded_row in zip(plain["measurements"][0]["results"], offloaded["measurements"][0]["results"]):
        moved = offloaded_row["offload_moved_bytes_per_pass"]
        print(f"| {row['batch_size']} | {row['tokens_per_second']:.2f} | {row['decode_ms_per_token']['median']:.1f} | "
              f"{offloaded_row['tokens_per_second']:.2f} | {offloaded_row['decode_ms_per_token']['median']:.1f} | "
              f"{offloaded_row['decode_ms_per_token']['median'] / row['decode_ms_per_token']['median']:.2f}x | "
              f"{moved / GIB:.2f} | {placement['disk_bytes'] / GIB:.2f} |")


if __name__ == "__main__":
    main()
