"""Rebuild accelgen's built-in default model (``core/default_model``).

``accelgen run`` falls back to this model when no ``--model`` is given. It is a
tiny BLOOM-architecture causal LM trained for a few minutes on CPU on the King
James Bible (public domain). It writes English-looking text and nothing more: it
exists so that accelgen works, and can be tested, with no download at all.

The text comes from Debian's ``bible-kjv-text`` package, which stores it in a
compressed format that its companion ``bible`` program decodes::

    apt-get install -y bible-kjv-text bible-kjv   # the text, and the program that decodes it
    python examples/build_default_model.py --minutes 5

``--text`` also accepts any plain-text file, or a folder of ``.txt`` files.
Training runs for a fixed wall-clock time, so two runs with the same seed are
similar but not bit-identical.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import BloomConfig, BloomForCausalLM, PreTrainedTokenizerFast

DEFAULT_TEXT = Path("/usr/lib/bible.data")  # where bible-kjv-text puts the text
INSTALL_HINT = "install it with: apt-get install -y bible-kjv-text bible-kjv (Debian/Ubuntu), or pass --text FILE"
BRS_MAGIC = b"EC02"  # header of the compressed files read by the `bible` program

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
MODEL_SHAPE = dict(hidden_size=128, n_layer=4, n_head=4)
CONTEXT = 128  # tokens per training window
BATCH = 16
PEAK_LR = 3e-3
WARMUP_FRACTION = 0.03  # of the time budget
PROMPT = "In the beginning"
#: A plain role-tagged chat template (Zephyr's layout), so that conversations (``--column messages``, ``--chat``, chat
#: batch requests) run on the built-in model: each message as ``<|role|>``, its text and ``</s>``; the generation
#: prompt opens the assistant's turn. The model was not trained on it: its replies read like the rest of its text.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TextMissing(Exception):
    """The training text could not be found or decoded."""


# ----------------------------------------------------------------------------- text


def read_source(path: Path) -> str:
    """Return the text of one file, decoding the `bible` program's format if needed."""
    with path.open("rb") as f:
        compressed = f.read(len(BRS_MAGIC)) == BRS_MAGIC
    if not compressed:
        return path.read_text(encoding="utf-8", errors="replace")
    program = shutil.which("bible")
    if program is None:
        raise TextMissing(f"{path} needs the `bible` program to decode; {INSTALL_HINT}")
    # -f turns pretty-printing off: one "Ge1:1 text" line per verse. The range covers the whole book.
    command = [program, "-f", "-p", str(path.parent), "-d", path.name, "Gen1:1-Rev22:21"]
    result = subprocess.run(command, capture_output=True, text=True, encoding="latin-1", check=False)
    if result.returncode != 0 or not result.stdout.strip():
        raise TextMissing(f"`{' '.join(command)}` failed: {result.stderr.strip() or 'no output'}")
    return result.stdout


def load_text(path: Path) -> str:
    """Read a text file, a `bible` data file, or every .txt/.data file in a folder."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".data"))
    else:
        files = [path] if path.is_file() else []
    if not files:
        raise TextMissing(f"no training text at {path}; {INSTALL_HINT}")
    return "\n\n".join(read_source(f) for f in files)


VERSE = re.compile(r"^\s*(?P<chapter>(?:[1-3]?\s?[A-Za-z]+\.?\s?)?\d+):\d+\s+")  # "Ge1:1 ", "1 John 3:16 ", "3:16 "
VERSE_NUMBER = re.compile(r"^\s+\d+\s+")  # pretty-printed "  12 text"
HEADER = re.compile(r"^\s*[1-3]?\s?[A-Z][A-Za-z ]*\s\d+\s*$")  # pretty-printed "Genesis 1"


def clean_text(raw: str) -> list[str]:
    """Turn verse-per-line scripture into prose: one paragraph per chapter, no references."""
    paragraphs: list[list[str]] = [[]]
    chapter = None
    for line in raw.splitlines():
        verse = VERSE.match(line)
        if verse and verse["chapter"] != chapter:
            chapter = verse["chapter"]
            paragraphs.append([])
        if verse:
            line = line[verse.end():]
        elif not line.strip() or HEADER.match(line):
            paragraphs.append([])
            continue
        else:
            line = VERSE_NUMBER.sub("", line)
        paragraphs[-1].append(line.strip())
    return [" ".join(" ".join(p).split()) for p in paragraphs if p]


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(paragraphs: list[str]) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    """Train a byte-level BPE tokenizer (GPT-2 style, no automatic <s>/</s>)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(paragraphs, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=1024,
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids: BLOOM does not take them
    )
    return tokenizer, wrapped


def encode_corpus(tokenizer: Tokenizer, paragraphs: list[str], eos_id: int) -> torch.Tensor:
    """One long stream of token ids, with </s> after every paragraph."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(paragraphs):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- model


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> BloomForCausalLM:
    torch.manual_seed(seed)
    config = BloomConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **MODEL_SHAPE,
    )
    return BloomForCausalLM(config)


def learning_rate(progress: float) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak, over the time budget (progress 0..1)."""
    if progress < WARMUP_FRACTION:
        return PEAK_LR * progress / WARMUP_FRACTION
    decay = (min(progress, 1.0) - WARMUP_FRACTION) / (1.0 - WARMUP_FRACTION)
    return PEAK_LR * (0.1 + 0.45 * (1.0 + math.cos(math.pi * decay)))


def random_batch(data: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - CONTEXT, (BATCH,), generator=generator)
    return torch.stack([data[s : s + CONTEXT] for s in starts.tolist()])


def train(model: BloomForCausalLM, data: torch.Tensor, minutes: float, seed: int) -> tuple[float, int]:
    """Train until the time budget is spent; return (smoothed final loss, steps)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.1, betas=(0.9, 0.95))
    budget = max(minutes * 60.0, 1.0)
    model.train()
    start, last_report, smoothed, step = time.monotonic(), 0.0, None, 0
    while (elapsed := time.monotonic() - start) < budget:
        lr = learning_rate(elapsed / budget)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = random_batch(data, generator)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if elapsed - last_report >= 15 or step == 1:
            print(f"step {step:5d}  {elapsed:6.0f}s  loss {smoothed:.3f}  lr {lr:.2e}", flush=True)
            last_report = elapsed
    model.eval()
    return smoothed, step


def sample(model: BloomForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str = PROMPT) -> str:
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=30, do_sample=False)
    return tokenizer.decode(output[0], skip_special_tokens=True)


# ----------------------------------------------------------------------------- output


MODEL_CARD = """\
# accelgen default model

A **demo model, not a useful language model.** `accelgen run` uses it when no
`--model` is given, so that accelgen works (and its tests run) without
downloading anything. It produces English-looking, King-James-flavoured text
with little meaning.

- Architecture: `BloomForCausalLM`, {n_layer} layers, hidden size {hidden_size}, {n_head} heads,
  ALiBi positions, tied input/output embeddings; {parameters:,} parameters, stored as bfloat16
  safetensors.
- Tokenizer: byte-level BPE trained on the same text, {vocab_size} tokens; special tokens
  `<pad>`, `<s>`, `</s>`, `<unk>`. No special tokens are added automatically; `</s>` ends
  each chapter in the training data.
- Chat template: each message as `<|role|>`, a new line, its text and `</s>`; the generation
  prompt is `<|assistant|>` and a new line. The model was not trained on conversations: the
  template lets `--chat`, `--column messages` and chat batch requests run, not converse.
- Training text: the King James Version of the Bible (1611), which is in the public domain,
  from Debian's `bible-kjv-text` package, with verse numbers and book headers removed
  (one paragraph per chapter; {tokens:,} tokens).
- Training: {minutes:g} minutes on {threads} CPU threads, {steps} AdamW steps of {batch} random
  windows of {context} tokens, cosine learning-rate decay; final training loss {loss:.2f}.
- Greedy sample: "{sample}"

Rebuild with `python examples/build_default_model.py` (see that script for options).
"""


def save(model, tokenizer, output: Path, stats: dict) -> None:
    output.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)
    # transformers 5 records its own class name, which transformers 4 cannot resolve; both versions
    # load the generic class from tokenizer.json.
    tokenizer_config = output / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text(encoding="utf-8"))
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    # the chat template in tokenizer_config.json, where every transformers release since 4.43 reads it
    settings["chat_template"] = CHAT_TEMPLATE
    (output / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    card = MODEL_CARD.format(**model.config.to_dict(), parameters=model.num_parameters(), **stats)
    (output / "README.md").write_text(card, encoding="utf-8")
    for file in output.iterdir():  # safetensors may be written owner-only; the package ships them
        file.chmod(0o644)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT,
                        help="training text: file or folder (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=Path("core/default_model"),
                        help="output folder (default: %(default)s)")
    parser.add_argument("--minutes", type=float, default=5.0, help="training time budget (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        paragraphs = clean_text(load_text(args.text))
    except TextMissing as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    torch.set_num_threads(2)
    print(f"text: {len(paragraphs)} paragraphs, {sum(map(len, paragraphs)):,} characters")
    raw_tokenizer, tokenizer = train_tokenizer(paragraphs)
    data = encode_corpus(raw_tokenizer, paragraphs, tokenizer.eos_token_id)
    model = build_model(tokenizer, args.seed)
    print(f"tokenizer: {len(tokenizer)} tokens; corpus: {len(data):,} tokens; "
          f"model: {model.num_parameters():,} parameters")
    loss, steps = train(model, data, args.minutes, args.seed)
    text = sample(model, tokenizer)
    print(f"final loss {loss:.3f} after {steps} steps\nsample: {text!r}")
    stats = dict(tokens=len(data), minutes=args.minutes, threads=torch.get_num_threads(), steps=steps,
                 batch=BATCH, context=CONTEXT, loss=loss, sample=text.replace("\n", " "))
    save(model, tokenizer, args.output, stats)
    size = sum(f.stat().st_size for f in args.output.iterdir() if f.is_file())
    print(f"saved to {args.output} ({size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
