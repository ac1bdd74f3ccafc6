"""The ``accelgen`` command: parses arguments and calls the core. Nothing here knows a device."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import pluggy

from accelgen.accelerators import AUTO_DEVICE, registered_accelerators
from accelgen.errors import UsageError
from accelgen.output import CompletionWriter, print_batch, describe_plugin
from accelgen.plugins import get_plugin_manager
from accelgen.settings import DEFAULT_BUCKETS, DTYPES


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as one line (and exit status 2) instead of usage text."""

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accelgen", description="Static-shape LLM text generation on any accelerator.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="generate completions for prompts")
    run.add_argument("--device", default=AUTO_DEVICE, help="accelerator name (see 'accelgen devices'); default: best available")
    run.add_argument("--model", help="Hub id or local folder (default: the built-in demo model)")
    run.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for several")
    run.add_argument("--max-new-tokens", type=int, default=100)
    run.add_argument("--max-input-tokens", type=int, help="keep only the first N tokens of each prompt")
    run.add_argument("--batch-size", type=int, default=1, help="fixed batch shape; the last batch is padded")
    run.add_argument("--dtype", choices=DTYPES, help="default: the device's (float32 on cpu)")
    run.add_argument("--buckets", type=_int_list, default=DEFAULT_BUCKETS, help="prompt length buckets, e.g. 32,64,128")
    run.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    run.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                     help="capture the decode step as a graph (default: the device decides)")
    run.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    run.add_argument("--temperature", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--trust-remote-code", action="store_true", help="allow model code from the Hub to run")
    run.add_argument("--output", help="write one JSON line per prompt to this file")
    run.add_argument("--quiet", action="store_true", help="print no completions, only the summary")

    commands.add_parser("devices", help="list every registered accelerator and whether it can run here")
    return parser


def main(argv: Sequence[str] | None = None, plugin_manager: pluggy.PluginManager | None = None) -> int:
    """Entry point of the ``accelgen`` script; returns the exit status (2 for a user mistake)."""
    try:
        arguments = build_parser().parse_args(argv)
        plugin_manager = plugin_manager or get_plugin_manager()
        if arguments.command == "devices":
            return devices_command(plugin_manager)
        return run_command(arguments, plugin_manager)
    except UsageError as error:
        print(f"accelgen: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("accelgen: interrupted", file=sys.stderr)
        return 130


def devices_command(plugin_manager: pluggy.PluginManager) -> int:
    for accelerator in registered_accelerators(plugin_manager).values():
        if accelerator.is_available():
            status = f"available, {accelerator.device_count()} device(s)"
        else:
            status = f"unavailable: {accelerator.unavailable_reason()}"
        print(f"{accelerator.name:<8} {status}  [{describe_plugin(accelerator)}]")
    return 0


def run_command(arguments: argparse.Namespace, plugin_manager: pluggy.PluginManager) -> int:
    import accelgen

    if not arguments.prompt:
        raise UsageError("No prompts given: pass --prompt TEXT (repeat it for several prompts).")
    for index, prompt in enumerate(arguments.prompt):
        if not prompt.strip():
            raise UsageError(f"Prompt {index} is empty: give it some text.")
    _quiet_transformers()
    writer = CompletionWriter.open(arguments.output) if arguments.output else None
    started = time.perf_counter()
    generator = accelgen.load(
        arguments.model,
        device=arguments.device,
        dtype=arguments.dtype,
        batch_size=arguments.batch_size,
        max_new_tokens=arguments.max_new_tokens,
        max_input_tokens=arguments.max_input_tokens,
        ignore_eos=arguments.ignore_eos,
        graphs=arguments.graphs,
        buckets=arguments.buckets,
        do_sample=arguments.do_sample,
        temperature=arguments.temperature,
        top_k=arguments.top_k,
        top_p=arguments.top_p,
        seed=arguments.seed,
        trust_remote_code=arguments.trust_remote_code,
        plugin_manager=plugin_manager,
    )
    loaded = time.perf_counter()
    is_main = generator.world.is_main
    try:
        for batch_number, completions in enumerate(generator.generate_batches(arguments.prompt), start=1):
            if is_main and not arguments.quiet:
                print_batch(batch_number, completions)
            if is_main and writer:
                writer.write(completions)
    finally:
        if writer:
            writer.close()
    if is_main:
        _print_summary(generator, load_seconds=loaded - started, total_seconds=time.perf_counter() - loaded)
    return 0


def _print_summary(generator, load_seconds: float, total_seconds: float) -> None:
    stats = generator.stats
    decode_seconds = sum(timing.decode_seconds for timing in stats.timings)
    decode_steps = sum(timing.decode_steps for timing in stats.timings)
    per_token_ms = 1000 * decode_seconds / max(decode_steps, 1)
    print(
        f"accelgen: {stats.new_tokens} new tokens in {total_seconds:.2f} s "
        f"({stats.new_tokens / max(total_seconds, 1e-9):.1f} tokens/s, decode {per_token_ms:.2f} ms/step), "
        f"model loaded in {load_seconds:.2f} s, device {generator.accelerator.name}, dtype {generator.run.dtype}, "
        f"graph captures: {stats.graph_captures}",
        file=sys.stderr,
    )


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None


def _quiet_transformers() -> None:
    """Keep transformers' progress bars and advice off the terminal; errors still surface as ours."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    hub_logging.set_verbosity_error()  # its retry chatter; the failure itself comes back as our one line


if __name__ == "__main__":
    sys.exit(main())
