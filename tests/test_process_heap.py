"""The garbage collector's passes over a process's start-up heap: a process that imported alignrl skips the
interpreter's last collections at exit (alignrl/__init__.py) and still does everything an exit must (its atexit
handlers run, its buffered output and open files are flushed); an entry point defers full collections through its
start-up (alignrl/runtime/heap.py)."""

import json
import subprocess
import sys

import pytest

# an object kept alive only by a reference cycle, which only the garbage collector can free
CYCLE = """
class Node:
    def __del__(self):
        print("collected", flush=True)
a = Node(); a.me = a; del a
"""


def run(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_the_last_collections_are_skipped_only_where_alignrl_was_imported(tmp_path):
    plain = run(CYCLE, tmp_path)
    assert plain.returncode == 0 and plain.stdout == "collected\n", plain.stderr  # Python's own exit frees it
    frozen = run("import alignrl\n" + CYCLE, tmp_path)
    assert frozen.returncode == 0 and frozen.stdout == "", frozen.stdout + frozen.stderr


def test_an_exit_still_flushes_output_and_files_and_runs_its_handlers(tmp_path):
    code = """
import alignrl, atexit, sys
atexit.register(lambda: open("handler.txt", "w").write("ran"))
log = open("log.txt", "w"); log.write("kept")  # never flushed nor closed by the program
sys.stdout.write("no newline, not flushed")
sys.exit(3)
"""
    out = run(code, tmp_path)
    assert out.returncode == 3 and out.stdout == "no newline, not flushed", out.stderr
    assert (tmp_path / "handler.txt").read_text() == "ran" and (tmp_path / "log.txt").read_text() == "kept"


@pytest.mark.parametrize("build", ["load_causal_lm", "meta_model"])  # a whole model; the start of a sharded one
def test_an_entry_point_defers_full_collections_until_its_first_model_is_loaded(build, tmp_path, tiny_model_dir):
    """`alignrl.runtime.heap`: a command's process collects its young generations throughout, its oldest ten times
    less often until start-up is over (the first model loaded), after which what it built is frozen and the
    thresholds are Python's."""
    code = f"""
import gc, json
from alignrl.runtime.heap import starting
from alignrl.models.loader import {build}
before = gc.get_threshold()
starting()
during = gc.get_threshold()
young = [s["collections"] for s in gc.get_stats()]
import transformers.modeling_utils  # hundreds of thousands of objects: young collections run, full ones wait
after_imports = [s["collections"] for s in gc.get_stats()]
{build}({str(tiny_model_dir)!r})
print(json.dumps([before, during, young, after_imports, gc.get_threshold(), gc.get_freeze_count()]))
"""
    out = run(code, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    before, during, young, after_imports, settled, frozen = json.loads(out.stdout.splitlines()[-1])
    assert during == [before[0], before[1], 10 * before[2]] and settled == before
    assert after_imports[0] > young[0] + 100 and after_imports[2] <= young[2] + 1  # not six or seven full passes
    assert frozen > 100_000


def test_a_caller_in_its_own_process_keeps_its_collector_as_it_was(tiny_model_dir):
    """Loading a model from a notebook or a test freezes nothing and changes no threshold: only an entry point's
    start-up is deferred (`alignrl.cli.main()` called without arguments, `python -m alignrl`)."""
    import gc

    from alignrl.models.loader import load_causal_lm

    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    load_causal_lm(tiny_model_dir)
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
