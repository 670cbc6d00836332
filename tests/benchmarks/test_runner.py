"""tests/support/benchmark_runner.py: a smoke run in this process leaves nothing behind for the next one, reports its
failures with the script's name and traceback, and cannot record under benchmarks/results/."""

from __future__ import annotations

import gc
import logging
import os
import runpy
import signal
import sys
import textwrap
from pathlib import Path

import torch

from tests.support.benchmark_runner import RESULTS, ROOT, run_in_process

MESSY = """
import gc, logging, os, random, signal, sys
import torch
import helper
helper.calls += 1
print("helper calls", helper.calls, "argv", sys.argv[1:], "cwd", os.getcwd())
print("dtype seen", torch.get_default_dtype(), "threads", torch.get_num_threads())
torch.set_default_dtype(torch.float64)
torch.set_num_threads(3)
torch.manual_seed(123)
random.seed(5)
torch.use_deterministic_algorithms(True)
torch.set_grad_enabled(False)
os.environ["H27S_LEAK"] = "1"
os.chdir("/")
sys.path.append("/nowhere")
logging.basicConfig(level=logging.DEBUG)
gc.callbacks.append(lambda phase, info: None)
signal.signal(signal.SIGTERM, lambda *a: None)
"""


def write(folder: Path, name: str, text: str) -> Path:
    (folder / name).write_text(textwrap.dedent(text))
    return folder / name


def state() -> tuple:
    return (
        torch.get_default_dtype(),
        torch.get_num_threads(),
        torch.get_rng_state().tolist(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_grad_enabled(),
        dict(os.environ),
        os.getcwd(),
        sys.path[:],
        logging.getLogger().level,
        list(logging.getLogger().handlers),
        list(gc.callbacks),
        signal.getsignal(signal.SIGTERM),
        "helper" in sys.modules,
    )


def test_a_smoke_that_changes_global_state_leaves_none_of_it_to_the_next(tmp_path):
    write(tmp_path, "helper.py", "calls = 0\n")
    script = write(tmp_path, "messy.py", MESSY)
    before = state()
    first = run_in_process(script, ["--smoke", "x"])
    assert first.code == 0, first.failure()
    assert state() == before
    second = run_in_process(script)  # sees what a fresh process would: float32, one thread, a fresh sibling module
    assert second.code == 0, second.failure()
    assert "helper calls 1 argv ['--smoke']" in second.stdout and f"cwd {ROOT}" in second.stdout
    assert "dtype seen torch.float32 threads 1" in second.stdout
    assert "argv ['--smoke', 'x']" in first.stdout
    assert state() == before


def test_the_state_check_sees_a_leak_without_the_runner(tmp_path):
    """The check above can fail: the same script through plain runpy leaves float64 and 3 threads behind."""
    write(tmp_path, "helper.py", "calls = 0\n")
    script = write(tmp_path, "messy.py", MESSY)
    before = state()
    sys.path.insert(0, str(tmp_path))
    cwd, env, threads = os.getcwd(), dict(os.environ), torch.get_num_threads()
    handlers, callbacks, term = list(logging.getLogger().handlers), list(gc.callbacks), signal.getsignal(signal.SIGTERM)
    path, level, rng = sys.path[:], logging.getLogger().level, torch.get_rng_state()
    try:
        runpy.run_path(str(script), run_name="__main__")
        assert torch.get_default_dtype() == torch.float64 and torch.get_num_threads() == 3
        assert state() != before
    finally:  # undone by hand, for the rest of the session
        torch.set_default_dtype(torch.float32)
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
        torch.use_deterministic_algorithms(False)
        torch.set_grad_enabled(True)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        sys.path.remove(str(tmp_path))
        logging.getLogger().handlers[:] = handlers
        logging.getLogger().setLevel(level)
        gc.callbacks[:] = callbacks
        signal.signal(signal.SIGTERM, term)
        sys.modules.pop("helper", None)
    assert state() == before


def test_a_failing_smoke_names_its_script_and_traceback(tmp_path):
    done = run_in_process(write(tmp_path, "broken.py", "print('table')\nraise ValueError('rows as dicts')\n"))
    assert done.code == 1
    message = done.failure()
    assert "broken.py --smoke exited 1" in message and "ValueError: rows as dicts" in message and "table" in message
    exited = run_in_process(write(tmp_path, "exits.py", "import sys\nsys.exit(3)\n"))
    assert exited.code == 3
    said = run_in_process(write(tmp_path, "says.py", "raise SystemExit('no GPU here')\n"))
    assert (said.code, said.error) == (1, "no GPU here")


def test_a_smoke_cannot_record_under_benchmarks_results(tmp_path):
    target = RESULTS / "h27s_must_not_exist.md"
    script = write(
        tmp_path,
        "records.py",
        f"""
        from pathlib import Path
        from record import print_and_record
        print_and_record(["| a |"], Path({str(target)!r}))
        """,
    )
    done = run_in_process(script)
    assert done.code == 1 and "RecordRefused" in done.error and "smoke runs record nothing" in done.error
    assert not target.exists()
    elsewhere = write(
        tmp_path,
        "elsewhere.py",
        f"""
        from pathlib import Path
        from record import print_and_record
        print_and_record(["| a |"], Path({str(tmp_path / "kept.md")!r}))
        """,
    )
    assert run_in_process(elsewhere).code == 0 and (tmp_path / "kept.md").read_text() == "| a |\n\n"


def test_what_its_child_processes_write_is_in_its_output(tmp_path):
    """Child processes and forked jobs write to file descriptors 1 and 2: their tracebacks reach the failure message."""
    script = write(
        tmp_path,
        "children.py",
        """
        import os, subprocess, sys
        subprocess.run([sys.executable, "-c", "print('from the child')"], check=True)
        pid = os.fork()
        if pid == 0:
            os.write(2, b"from the fork\\n")
            os._exit(0)
        os.waitpid(pid, 0)
        print("from the script")
        """,
    )
    done = run_in_process(script)
    assert done.code == 0, done.failure()
    assert "from the child" in done.stdout and "from the script" in done.stdout and "from the fork" in done.stderr
