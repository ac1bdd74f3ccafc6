"""Dataset completion throughput: fixed batches against continuous batching, and Hugging Face's two ways.

The workload is what dataset completion meets: prompts of 3 to 40 words, sampled completions that end at
very different lengths. The model is a random-weight Llama (a shape whose decode step takes a few ms at
batch 16 on a 2-core CPU); its generation config ends a row at any token of an "ending set" of
``vocab / mean_length`` tokens, so that a row sampled from the nearly flat distribution of random weights
ends after about ``--mean-length`` tokens: lengths are spread geometrically (median about 0.7 of the mean,
a few percent reaching ``--max-new-tokens``), and every contender meets the same distribution. The lengths
each contender actually produced are printed with its figures.

Contenders, in one process, interleaved round by round (machine noise hits all alike; the order reversed every other
round, so that none always runs after the same one), medians reported:

    accelgen_static      accelgen run's fixed batches (--batching static)
    accelgen_continuous  accelgen's continuous batching inside static shapes (--batching continuous)
    hf_generate          Hugging Face generate() over padded batches of the same size
    hf_generate_batch    Hugging Face generate_batch() (transformers 5.x continuous batching, paged attention)

Asked for by name (``--contenders``), not run by default:

    accelgen_continuous_stop  continuous batching with two --stop texts that never occur: the rows and tokens
                              of accelgen_continuous, plus the cost of looking for stop texts at every look
    accelgen_continuous_samples4  continuous batching, --num-samples 4 of every fourth prompt: as many rows as
                              accelgen_continuous, each prompt prefilled once for its four samples
    accelgen_continuous_noreuse  continuous batching without the store of prompt prefixes (--prefix-cache 0):
                              against accelgen_continuous, what reusing prefixes gains, or costs when none is shared
    accelgen_continuous_unchunked  continuous batching with every prompt prefilled in one pass (--prefill-chunk 0):
                              against accelgen_continuous (chunks of 512), how long a long prompt holds the running rows
    accelgen_continuous_lora4  continuous batching with the rows spread in turn over 4 LoRA adapters of rank
                              ``--lora-rank`` (16) on ``--lora-targets`` (every linear layer), all four in the buffers:
                              against accelgen_continuous, what computing each row's own adapter in the step costs
    accelgen_continuous_merged  continuous batching with one such adapter merged into the weights (--lora PATH)
    accelgen_continuous_schemas  continuous batching, each row held to one of the four :data:`EXTRACTION_SCHEMAS` (row
                              number modulo 4, as --schema-column gives them): against accelgen_continuous on the same
                              rows, what structured output costs; every row that ended by its grammar is checked to
                              parse and validate against its schema (``jsonschema``)
    accelgen_continuous_open_mask  continuous batching, no row held to a schema, in a run set for rows that bring
                              theirs: every decode step applies a mask that allows every token, and the host follows no
                              row; against accelgen_continuous, what the mask costs inside the step alone

Workloads (``--workload``): ``varied`` (the default, above); ``shared-prefix``, every row a few-shot block of
``--prefix-tokens`` tokens (512) shared by all rows, then 10 to 40 tokens of its own. Each round has prompts of its
own (same lengths' distribution), so that no round finds the one before's prompts stored. ``long-prompt``: the
``varied`` prompts with two of ``--long-tokens`` tokens (4,000) among them, the first at the start (it makes the slots
hold long prompts from then on, as a dataset's first long prompt does: growing them waits for every slot to empty)
and the second in the middle, which comes while rows run. Every accelgen contender reports the longest wait of
running rows between two decode steps and the longest prefill pass (ms, the longest of the rounds). ``structured``:
the ``varied`` prompts, run with and without the four extraction schemas (``accelgen_continuous`` against
``accelgen_continuous_schemas``, the default contenders of this workload). Without a schema a row of random weights ends
at its ending set (about ``--mean-length`` tokens); with one it ends when its grammar is complete, the ending set being
what the grammar allows then: both sides run the same rows under the same cap and seed, and their kept tokens/s (each
row's tokens up to its end) are compared, with the decode step's ms and the lengths each side produced.

With ``--baseline REV``, a fifth contender, ``baseline_static``, is accelgen's fixed batches as commit REV has them:
a worker process importing accelgen from a git worktree of REV, sent each round's prompts in turn with the
others, so a change of the engine is measured against the code before it in the same run. Every accelgen
contender also reports its decode step (ms per step: decode time over decode steps).

Kept tokens are each row's new tokens up to its end; slot occupancy (accelgen) is kept tokens over the token
places computed. accelgen's two modes write the same text (same seed); Hugging Face draws its own samples.

    python benchmarks/dataset_throughput.py                            # 192 prompts, batch 16, 128-token cap
    python benchmarks/dataset_throughput.py --prompts 64 --rounds 1    # quick look
    python benchmarks/dataset_throughput.py --baseline HEAD~1          # against the previous commit's fixed batches
    python benchmarks/dataset_throughput.py --workload shared-prefix --contenders accelgen_continuous,accelgen_continuous_noreuse
    python benchmarks/dataset_throughput.py --workload long-prompt --contenders accelgen_continuous,accelgen_continuous_unchunked
    python benchmarks/dataset_throughput.py --contenders accelgen_continuous,accelgen_continuous_lora4,accelgen_continuous_merged
    python benchmarks/dataset_throughput.py --workload structured
    python benchmarks/dataset_throughput.py --device cuda --layers 30 --hidden 4096 --heads 32 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

import accelgen
from accelgen.generation.text import Completion
from accelgen.loading.model_files import DEFAULT_MODEL, load_tokenizer

CONTENDERS = ("accelgen_static", "accelgen_continuous", "hf_generate", "hf_generate_batch")
STRUCTURED_CONTENDERS = ("accelgen_continuous", "accelgen_continuous_schemas")

#: Four schemas of the shapes people extract: nested objects, enums, arrays of objects, numbers with bounds, required
#: fields. Their completions' lengths vary with the arrays' items and the strings' and numbers' lengths.
EXTRACTION_SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["name", "age", "address"], "additionalProperties": False},
    {"type": "object", "properties": {
        "label": {"enum": ["positive", "negative", "neutral", "mixed"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4}},
     "required": ["label", "confidence", "keywords"], "additionalProperties": False},
    {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 8}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0, "maximum": 10000}},
            "required": ["sku", "quantity", "price"], "additionalProperties": False}},
        "paid": {"type": "boolean"}},
     "required": ["order_id", "items", "paid"], "additionalProperties": False},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 20},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
        "priority": {"enum": ["low", "medium", "high"]},
        "attendees": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 10}, "role": {"enum": ["host", "guest"]}},
            "required": ["name", "role"], "additionalProperties": False}, "maxItems": 3}},
     "required": ["title", "date", "priority", "attendees"], "additionalProperties": False},
]


def build_workload(arguments, folder: Path) -> tuple[Callable[[int], list[str]], list[int]]:
    """The model folder (random Llama, the built-in tokenizer, an ending set in its generation config), and the
    prompts of each round (``prompts_of(round)``; -1: the warm-up's): 3 to 40 words of the tokenizer's vocabulary,
    seeded, other words each round (a store of prompt prefixes must not find a round's prompts from the one
    before); with ``--workload shared-prefix``, a few-shot block of ``--prefix-tokens`` tokens, the same in every
    row and round, then 10 to 40 tokens of the row's own."""
    tokenizer = load_tokenizer(str(DEFAULT_MODEL))
    vocab = len(tokenizer)
    config = LlamaConfig(vocab_size=vocab, hidden_size=arguments.hidden, intermediate_size=arguments.hidden * 8 // 3,
                         num_hidden_layers=arguments.layers, num_attention_heads=arguments.heads,
                         num_key_value_heads=arguments.heads,
                         max_position_embeddings=8192 if arguments.workload == "long-prompt" else 1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    draw = random.Random(0)
    ending = sorted(draw.sample(range(3, vocab), max(1, vocab // arguments.mean_length)))
    GenerationConfig(eos_token_id=ending, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id
                     ).save_pretrained(folder)
    words = [word for word in (tokenizer.decode([token]).strip() for token in range(vocab)) if word.isalpha()]

    def text_of(tokens: int, words_from: random.Random) -> str:
        """Words drawn until they make at least ``tokens`` tokens."""
        text = words_from.choice(words)
        while len(tokenizer(text, add_special_tokens=False).input_ids) < tokens:
            text += " " + words_from.choice(words)
        return text

    shared = text_of(arguments.prefix_tokens, random.Random(1)) + "\n" if arguments.workload == "shared-prefix" else ""

    def prompts_of(round_number: int) -> list[str]:
        words_from = draw if round_number == 0 else random.Random(1000 + round_number)  # round 0: as before rounds
        if not shared:
            prompts = [" ".join(words_from.choice(words) for _ in range(words_from.randint(3, 40)))
                       for _ in range(arguments.prompts)]
            if arguments.workload == "long-prompt":
                for place in (0, len(prompts) // 2):
                    prompts[place] = text_of(arguments.long_tokens - 8, words_from)
            return prompts
        return [shared + text_of(words_from.randint(10, 40), words_from) for _ in range(arguments.prompts)]

    first = prompts_of(0)  # drawn first, as the rounds did before they had prompts of their own
    return lambda round_number: first if round_number == 0 else prompts_of(round_number), ending


def output_rows(path: Path) -> list[dict]:
    """The rows of an ``accelgen run --output`` file, split at newlines only: ``str.splitlines`` also splits at U+2028
    and U+0085, which a sampled completion may hold raw (``json.dumps(ensure_ascii=False)`` leaves them)."""
    return [json.loads(line) for line in path.read_text().split("\n") if line]


def kept_length(row: list[int], ending: set[int]) -> int:
    for position, token in enumerate(row):
        if token in ending:
            return position + 1
    return len(row)


#: Stop texts no completion of the workload holds (checked: the kept tokens equal accelgen_continuous's).
NEVER_STOPS = ["<|never|>", "<|nor this|>"]


def write_adapters(folder: Path, model_folder: Path, arguments) -> list[Path]:
    """Four LoRA adapters of rank ``--lora-rank`` over ``--lora-targets`` of the workload's model, written as PEFT writes
    them (``adapter_config.json``, ``adapter_model.safetensors``), seeded: A drawn as PEFT initialises it, B so small
    that the sampled tokens stay the base model's: every contender then decodes the same rows to the same lengths, and
    the figures differ by what computing the adapters costs, not by the work (an adapter's values cost nothing more)."""
    from safetensors.torch import save_file

    config = LlamaConfig.from_pretrained(model_folder)
    features = {"q_proj": (config.hidden_size, config.hidden_size), "k_proj": (config.hidden_size, config.hidden_size),
                "v_proj": (config.hidden_size, config.hidden_size), "o_proj": (config.hidden_size, config.hidden_size),
                "gate_proj": (config.hidden_size, config.intermediate_size),
                "up_proj": (config.hidden_size, config.intermediate_size),
                "down_proj": (config.intermediate_size, config.hidden_size)}
    targets, rank = arguments.lora_targets.split(","), arguments.lora_rank
    generator = torch.Generator().manual_seed(0)
    adapters = []
    for number in range(4):
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for target in targets:
                inputs, outputs = features[target]
                module = f"model.layers.{layer}.{'self_attn' if target.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{target}"
                tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, inputs, generator=generator) / inputs ** 0.5
                tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(outputs, rank, generator=generator) * 1e-6
        adapter = folder / f"adapter-{number}"
        adapter.mkdir(parents=True)
        save_file(tensors, adapter / "adapter_model.safetensors")
        (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                                 "target_modules": targets, "bias": "none"}))
        adapters.append(adapter)
    return adapters


def accelgen_contender(folder, arguments, batching, schemas: bool = False, open_mask: bool = False, adapters: bool = False,
                       **settings):
    """``schemas``: each row held to one of :data:`EXTRACTION_SCHEMAS` (its number modulo 4), its completion checked;
    ``open_mask``: a run set for rows with schemas, given none; ``adapters``: the rows given in turn to the four LoRA
    adapters named a0 to a3 (``lora`` among ``settings``)."""
    if arguments.workload == "long-prompt":
        settings["buckets"] = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    generator = accelgen.load(str(folder), device=arguments.device, dtype=arguments.dtype, batch_size=arguments.batch_size,
                              max_new_tokens=arguments.max_new_tokens, do_sample=True, seed=0, batching=batching, **settings)
    if schemas or open_mask:  # rows that may bring their own structure, as a --schema-column job's do
        from accelgen.generation.generator import Generator  # here: a --baseline worker's accelgen may predate them

        generator = Generator(generator.loaded, dataclasses.replace(generator.run, structured_rows=True))
    chose = getattr(generator.accelerator, "summary_phrase", lambda: None)()  # a baseline from before it has none
    if chose:
        print(f"accelgen {batching}: device {arguments.device} ({chose})", flush=True)

    samples = settings.get("num_samples", 1)
    names = [f"a{number}" for number in range(4)] if adapters else None  # named adapters: rows go to them in turn

    def run(prompts):
        stats = generator.stats
        def prompt_counts():  # a baseline from before these counts has none
            return getattr(stats, "prompt_tokens", 0), getattr(stats, "prefilled_tokens", 0)

        before = (stats.new_tokens, stats.slot_tokens, len(stats.timings), *prompt_counts())
        waits = hasattr(stats, "longest_decode_gap")  # a baseline from before these has none
        if waits:
            stats.longest_decode_gap = stats.longest_prefill_pass = 0.0
        mask_before = getattr(stats, "mask_seconds", 0.0)
        rows = structured_rows(prompts) if schemas else prompts[::samples]
        chosen = {"adapters": [names[row % 4] for row in range(len(rows))]} if names else {}  # a baseline has no adapters
        completions = generator.generate(rows, **chosen)
        if schemas:
            run.checks.append(check_structured(completions, stats, stats.mask_seconds - mask_before))
        if samples > 1:  # one row per sample
            completions = [Completion(**sample | {"index": 0, "prompt": "", "prompt_token_count": 0})
                           for completion in completions for sample in completion.completions]
        kept, places = stats.new_tokens - before[0], stats.slot_tokens - before[1]
        timings = stats.timings[before[2]:]  # one per batch or one per call, as the version counts them
        step_ms = 1000 * sum(timing.decode_seconds for timing in timings) / max(sum(timing.decode_steps for timing in timings), 1)
        prompted, prefilled = (after - earlier for after, earlier in zip(prompt_counts(), before[3:]))
        prefilled = prefilled / prompted if prompted else None
        waited = (1000 * stats.longest_decode_gap, 1000 * stats.longest_prefill_pass) if waits else None
        return [len(completion.completion_token_ids) for completion in completions], kept / places, step_ms, prefilled, waited

    run.checks = []  # with schemas: each round's check_structured
    return run


def structured_rows(prompts: list[str]) -> list:
    """The prompts, row n held to schema n modulo 4."""
    from accelgen.common.prompts import PromptRequest
    from accelgen.common.settings import RowSettings
    from accelgen.common.structure import schema_structure

    return [PromptRequest(prompt, RowSettings(structure=schema_structure(EXTRACTION_SCHEMAS[number % 4])), None)
            for number, prompt in enumerate(prompts)]


def check_structured(completions: list[Completion], stats, mask_seconds: float) -> dict:
    """Rows that ended by their grammar, how many of them parse and validate against their schema, and what following
    their grammars cost: the host's mask work over the round's decode seconds, the grammars' compile seconds (so far)."""
    import jsonschema

    ended = [(completion, EXTRACTION_SCHEMAS[number % 4]) for number, completion in enumerate(completions)
             if completion.finish_reason == "stop"]
    valid = 0
    for completion, schema in ended:
        try:
            jsonschema.validate(json.loads(completion.completion), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            print(f"INVALID: {completion.completion!r}", flush=True)
    decode_seconds = stats.timings[-1].decode_seconds
    return {"rows": len(completions), "ended": len(ended), "valid": valid, "mask_share": mask_seconds / decode_seconds,
            "compile_seconds": stats.grammar_compile_seconds}


def baseline_contender(folder, arguments, scratch: Path):
    """accelgen's fixed batches at commit ``arguments.baseline``, in a worker process driven round by round."""
    tree = scratch / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), arguments.baseline], check=True,
                   capture_output=True, cwd=Path(__file__).resolve().parent)
    imports = scratch / "baseline-imports"
    imports.mkdir()
    for package, where in (("accelgen", "core"), ("accelgen_cpu", "plugins/cpu")):
        (imports / package).symlink_to(tree / where)
    environment = {**os.environ, "PYTHONPATH": str(imports)}
    worker = subprocess.Popen([sys.executable, __file__, "--worker", str(folder), *sys.argv[1:]], env=environment,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(prompts):
        worker.stdin.write(json.dumps(prompts) + "\n")
        worker.stdin.flush()
        while not (line := worker.stdout.readline()).startswith("["):  # libraries' own prints pass by
            if not line:
                raise RuntimeError(f"the baseline worker ({arguments.baseline}) ended")
        return tuple(json.loads(line))

    def close():
        worker.stdin.close()
        worker.wait()
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], capture_output=True,
                       cwd=Path(__file__).resolve().parent)

    return run, close


def serve_as_worker(folder: str, arguments) -> None:
    """The baseline's side: accelgen (as imported from PYTHONPATH) runs each line's prompts, answers one line."""
    import accelgen as imported

    assert Path(imported.__file__).resolve().parent != Path(__file__).resolve().parent.parent / "core"
    run = accelgen_contender(folder, arguments, "static")
    for line in sys.stdin:
        print(json.dumps(run(json.loads(line))), flush=True)


def hugging_face_contender(folder, arguments, ending, continuous: bool):
    tokenizer = load_tokenizer(str(folder))
    tokenizer.padding_side = "left"
    dtype = getattr(torch, arguments.dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(arguments.device).eval()
    config = GenerationConfig(max_new_tokens=arguments.max_new_tokens, do_sample=True, top_k=0, eos_token_id=ending,
                              pad_token_id=tokenizer.pad_token_id)
    ending_set = set(ending)

    def run_padded(prompts):
        lengths = []
        for start in range(0, len(prompts), arguments.batch_size):
            inputs = tokenizer(prompts[start : start + arguments.batch_size], return_tensors="pt", padding=True,
                               return_token_type_ids=False).to(arguments.device)
            with torch.no_grad():
                output = model.generate(**inputs, generation_config=config)
            lengths += [kept_length(row, ending_set) for row in output[:, inputs.input_ids.shape[1] :].tolist()]
        return lengths, None, None, None

    def run_continuous(prompts):
        inputs = [tokenizer(prompt)["input_ids"] for prompt in prompts]
        with torch.no_grad():
            outputs = model.generate_batch(inputs=inputs, generation_config=config)
        return [kept_length(output.generated_tokens, ending_set) for output in outputs.values()], None, None, None

    return run_continuous if continuous else run_padded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--mean-length", type=int, default=40, help="about how many tokens a completion has")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--workload", choices=("varied", "shared-prefix", "long-prompt", "structured"), default="varied",
                        help="shared-prefix: every row begins with the same --prefix-tokens tokens; long-prompt: two "
                             "prompts of --long-tokens among the varied ones; structured: the varied prompts with and "
                             "without four extraction schemas")
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the LoRA contenders' adapters")
    parser.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                        help="the layers the LoRA contenders' adapters adapt")
    parser.add_argument("--contenders", help=f"default: {','.join(CONTENDERS)} ({','.join(STRUCTURED_CONTENDERS)} for "
                                             f"--workload structured)")
    parser.add_argument("--baseline", help="a git revision whose fixed batches run as a contender too")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        serve_as_worker(arguments.worker, arguments)
        return
    names = (arguments.contenders or ",".join(STRUCTURED_CONTENDERS if arguments.workload == "structured"
                                              else CONTENDERS)).split(",")
    closers = []

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        prompts_of, ending = build_workload(arguments, folder)
        contenders, adapters = {}, None
        for name in names:
            if name == "accelgen_continuous_stop":
                contenders[name] = accelgen_contender(folder, arguments, "continuous", stop=NEVER_STOPS)
            elif name == "accelgen_continuous_noreuse":
                contenders[name] = accelgen_contender(folder, arguments, "continuous", prefix_cache=0)
            elif name == "accelgen_continuous_unchunked":
                contenders[name] = accelgen_contender(folder, arguments, "continuous", prefill_chunk=0)
            elif name == "accelgen_continuous_samples4":
                contenders[name] = accelgen_contender(folder, arguments, "continuous", num_samples=4)
            elif name in ("accelgen_continuous_lora4", "accelgen_continuous_merged"):
                adapters = adapters or write_adapters(Path(scratch) / "adapters", folder, arguments)
                lora = [f"a{number}={path}" for number, path in enumerate(adapters)] if name.endswith("lora4") \
                    else str(adapters[0])
                contenders[name] = accelgen_contender(folder, arguments, "continuous", adapters=name.endswith("lora4"),
                                                      lora=lora)
            elif name == "accelgen_continuous_schemas":
                contenders[name] = accelgen_contender(folder, arguments, "continuous", schemas=True)
            elif name == "accelgen_continuous_open_mask":
                contenders[name] = accelgen_contender(folder, arguments, "continuous", open_mask=True)
            elif name.startswith("accelgen"):
                contenders[name] = accelgen_contender(folder, arguments, name.removeprefix("accelgen_"))
            else:
                contenders[name] = hugging_face_contender(folder, arguments, ending, continuous=name == "hf_generate_batch")
        if arguments.baseline:
            names.append("baseline_static")
            contenders["baseline_static"], close = baseline_contender(folder, arguments, Path(scratch))
            closers.append(close)
        for run in contenders.values():  # warm-up: captures, compilation, allocator
            run(prompts_of(-1)[: arguments.batch_size])
        results = {name: [] for name in names}
        for round_number in range(arguments.rounds):
            prompts = prompts_of(round_number)
            in_turn = list(contenders.items())
            for name, run in in_turn if round_number % 2 == 0 else in_turn[::-1]:  # each goes first and last alike
                started = time.perf_counter()
                lengths, occupancy, step_ms, prefilled, *waited = run(prompts)
                seconds = time.perf_counter() - started
                results[name].append((sum(lengths) / seconds, seconds, lengths, occupancy, step_ms, prefilled,
                                      waited[0] if waited else None))
        for close in closers:
            close()

    what = {"varied": "3-40 words", "shared-prefix": f"a shared {arguments.prefix_tokens}-token prefix and 10-40 tokens "
                                                     f"of their own",
            "long-prompt": f"3-40 words, two of them (first and middle) of {arguments.long_tokens} tokens",
            "structured": "3-40 words, with and without four extraction schemas"}[arguments.workload]
    base = "accelgen_static" if "accelgen_static" in results else names[0]
    print(f"workload: {len(prompts)} prompts of {what}, batch {arguments.batch_size}, cap {arguments.max_new_tokens} "
          f"new tokens, ending set of {len(ending)} tokens; Llama {arguments.layers} layers, hidden {arguments.hidden}, "
          f"{arguments.dtype} on {arguments.device}, {torch.get_num_threads()} threads; medians of {arguments.rounds} round(s)")
    print("| contender | kept tokens/s | s | kept tokens | mean / median length | at cap | slot occupancy | decode step ms "
          f"| prompt tokens prefilled | longest wait / prefill pass ms | vs {base} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    static_rate = statistics.median(rate for rate, *_ in results[base]) if base in results else None
    for name, rows in results.items():
        rate = statistics.median(row[0] for row in rows)
        seconds = statistics.median(row[1] for row in rows)
        lengths = rows[-1][2]
        occupancy = rows[-1][3]
        step_ms = None if rows[-1][4] is None else statistics.median(row[4] for row in rows)
        at_cap = sum(length == arguments.max_new_tokens for length in lengths) / len(lengths)
        print(f"| {name} | {rate:.0f} | {seconds:.2f} | {sum(lengths)} | {statistics.mean(lengths):.1f} / "
              f"{statistics.median(lengths):.0f} | {100 * at_cap:.0f}% | "
              f"{'' if occupancy is None else f'{100 * occupancy:.0f}%'} | "
              f"{'' if step_ms is None else f'{step_ms:.2f}'} | "
              f"{'' if rows[-1][5] is None else f'{100 * statistics.median(row[5] for row in rows):.1f}%'} | "
              f"{'' if rows[-1][6] is None else '%.0f / %.0f' % tuple(max(row[6][n] for row in rows) for n in (0, 1))} | "
              f"{'' if not static_rate else f'{rate / static_rate:.2f}x'} |")
    for name, run in contenders.items():
        for number, check in enumerate(getattr(run, "checks", [])[1:]):  # the warm-up's first
            print(f"{name} round {number}: {check['ended']} of {check['rows']} rows ended by their grammar, "
                  f"{check['valid']} of them valid JSON of their schema; the host's mask work "
                  f"{100 * check['mask_share']:.1f}% of decode time; grammars compiled in {check['compile_seconds']:.3f} s")


if __name__ == "__main__":
    main()
