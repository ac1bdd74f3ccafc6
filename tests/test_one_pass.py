"""A run does each piece of work once: every weight file's header is read once, a CPU run never reaches for
Habana's software, and the command line starts without torch."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
from transformers import AutoModelForCausalLM

from accelgen.cli import main
from accelgen.loading import checkpoint_files


@pytest.fixture
def counted_header_reads(monkeypatch):
    reads = Counter()
    read = checkpoint_files.read_safetensors_header

    def counting(path):
        reads[os.path.basename(path)] += 1
        return read(path)

    monkeypatch.setattr(checkpoint_files, "read_safetensors_header", counting)
    return reads


def test_each_weight_file_header_is_read_once_per_run(tmp_path, tiny_model_folder, counted_header_reads):
    """A checkpoint in three shards (with its index): checked before loading, loaded, recorded: one read each."""
    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder("llama"))
    model.save_pretrained(sharded, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((tiny_model_folder("llama") / name).read_bytes())
    shards = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()
    assert len(set(shards)) >= 3

    assert main(["run", "--device", "cpu", "--model", str(sharded), "--prompt", "Hello", "--max-new-tokens", "3",
                 "--output", str(tmp_path / "out.jsonl")]) == 0
    assert counted_header_reads == Counter({name: 1 for name in set(shards)})


def test_a_pre_sharded_folder_reads_each_rank_file_header_once(tmp_path, tiny_model_folder, counted_header_reads):
    folder = tmp_path / "tp1"
    assert main(["shard", "--device", "cpu", "--model", str(tiny_model_folder("opt")), "--world-size", "1",
                 "--dtype", "float32", "--output", str(folder)]) == 0
    counted_header_reads.clear()
    assert main(["run", "--device", "cpu", "--model", str(folder), "--prompt", "Hello", "--max-new-tokens", "3"]) == 0
    rank_files = [name for name in os.listdir(folder) if name.endswith(".safetensors")]
    assert rank_files and counted_header_reads == Counter({name: 1 for name in rank_files})


def _run_python(code: str, environment: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=300)


def test_a_cpu_run_never_imports_habana_software(tmp_path, tiny_model_folder, cli_environment):
    """A stand-in habana_frameworks package that records being imported: `--device cpu` must not touch it."""
    marker = tmp_path / "imported"
    package = tmp_path / "site" / "habana_frameworks"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    environment = dict(cli_environment, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), cli_environment.get("PYTHONPATH", "")]))
    result = _run_python(
        "import sys; from accelgen.cli import main; sys.exit(main(['run', '--device', 'cpu', '--model', "
        f"{str(tiny_model_folder('gpt2'))!r}, '--prompt', 'Hello', '--max-new-tokens', '2']))", environment)
    assert result.returncode == 0, result.stderr
    assert not marker.exists()
    # the stand-in is found where a real one would be: `accelgen devices` asks Gaudi's availability and imports it
    result = _run_python("import sys; from accelgen.cli import main; sys.exit(main(['devices']))", environment)
    assert result.returncode == 0, result.stderr
    assert marker.exists()


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["compare", "--help"]])
def test_the_command_line_starts_without_torch(argv, cli_environment):
    result = _run_python(
        "import sys\nfrom accelgen.cli import main\ntry:\n    main(" + repr(argv) + ")\nexcept SystemExit:\n    pass\n"
        "print(sorted(name for name in ('torch', 'transformers', 'datasets', 'deepspeed') if name in sys.modules))",
        cli_environment)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_accelgen_compare_runs_without_torch(tmp_path, cli_environment):
    from accelgen.bench.result_file import SCHEMA, SCHEMA_VERSION

    row = {"batch_size": 1, "status": "ok", "end_to_end_s": {"median": 1.0, "p90": 1.0}}
    record = {"label": "cpu", "model": {"name": "m"}, "world_size": 1, "dtype": "float32",
              "protocol": {"max_new_tokens": 100, "prompt": "p", "decoding": "greedy", "ignore_eos": True},
              "results": [row]}
    result_file = tmp_path / "r.json"
    result_file.write_text(json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "source": "measured",
                                       "measurements": [record]}))
    result = _run_python(
        f"import sys\nfrom accelgen.cli import main\nstatus = main(['compare', {str(result_file)!r}])\n"
        "print('torch' in sys.modules)\nsys.exit(status)", cli_environment)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"
