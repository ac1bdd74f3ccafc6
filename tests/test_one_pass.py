"""A run does each piece of work once: every weight file's header is read once, a CPU run never reaches for
Habana's software, the command line starts without torch, and the script's start is traversed by no full collection."""

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


def _run_python(code: str, environment: dict, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *arguments], env=environment, capture_output=True, text=True,
                          timeout=300)


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


#: Runs the command line in a process of its own (``entry``: ``script``, as the ``accelgen`` script does, or ``main``, as a
#: program calls it) and prints the generations of the collections made before and after the start's objects were
#: frozen, how many are frozen at the end, and the collector's thresholds then.
COLLECTIONS_OF_A_RUN = """
import gc, json, sys
events = []
gc.callbacks.append(lambda phase, info: phase == "start" and events.append((info["generation"], gc.get_freeze_count() > 0)))
thresholds = gc.get_threshold()
from accelgen import cli
status = getattr(cli, sys.argv[1])(sys.argv[2:])
print(json.dumps({"status": status, "before": [generation for generation, frozen in events if not frozen],
                  "after": [generation for generation, frozen in events if frozen], "frozen": gc.get_freeze_count(),
                  "thresholds_kept": gc.get_threshold() == thresholds}))
"""


def _collections_of_a_run(entry: str, model: str, environment: dict) -> dict:
    argv = ["run", "--device", "cpu", "--model", model, "--prompt", "Hello", "--max-new-tokens", "16", "--ignore-eos"]
    result = _run_python(COLLECTIONS_OF_A_RUN, environment, entry, *argv)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_script_leaves_what_its_start_builds_out_of_the_collectors_traversals(tiny_model_folder, cli_environment):
    """The start (torch, transformers, the model) makes no full collection; once the model is loaded its objects are
    frozen and the collector collects the generation's garbage at its usual thresholds; at exit every object is frozen
    (the interpreter's last collections traverse nothing)."""
    collections = _collections_of_a_run("script", str(tiny_model_folder("llama")), cli_environment)
    assert collections["status"] == 0
    assert 2 not in collections["before"]
    assert collections["after"] and collections["thresholds_kept"]
    assert collections["frozen"] > 100_000


def test_main_called_from_python_leaves_the_collector_as_it_is(tiny_model_folder, cli_environment):
    """Freezing in a program's own process would keep its garbage for the life of the process."""
    collections = _collections_of_a_run("main", str(tiny_model_folder("llama")), cli_environment)
    assert collections["status"] == 0
    assert collections["frozen"] == 0 and collections["thresholds_kept"] and not collections["after"]


def test_the_installed_script_is_the_one_that_keeps_the_start_out_of_the_collector():
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="accelgen")
    assert script.value == "accelgen.cli:script"
