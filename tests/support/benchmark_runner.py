"""Run a benchmark script's `--smoke` inside this process (runpy), so torch and transformers are imported once for
all of them rather than once per script: ~18 fresh processes each importing both were most of tests/benchmarks'
CPU time (benchmarks/results/startup.md, "Benchmark smokes in one process").

Each run is isolated: sys.argv, sys.path, the working directory, os.environ, torch's global state (threads, default
dtype and device, RNG, deterministic flags, grad mode, matmul precision), Python's and numpy's RNG, the
kernel-backend binding (`dflash_eval.extract.backends`), logging, warnings filters, signal handlers, gc callbacks
and thresholds, and the benchmark siblings it imported (record, evaluator_speed, ...) are restored after it,
whatever it did. `record.print_and_record` is guarded: a smoke that asks to write under benchmarks/results/ fails
before anything is written. `run_in_subprocess` is the fallback for a script that needs its own process.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import logging
import os
import random
import resource
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_eval.extract import backends

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


@dataclass
class SmokeRun:
    """What one run gave: exit code (0 = success), its stdout and stderr, the traceback if it raised, wall seconds,
    CPU seconds (user + system) of this process and of the child processes it waited for."""

    script: Path
    code: int
    stdout: str
    stderr: str
    error: str
    seconds: float
    cpu_s: float = 0.0
    children_cpu_s: float = 0.0

    def failure(self) -> str:
        """A message for a failed run, naming the script, with the end of its output and its traceback."""
        return (
            f"{self.script.relative_to(ROOT) if self.script.is_relative_to(ROOT) else self.script} "
            f"--smoke exited {self.code} after {self.seconds:.1f} s\n--- stdout (end) ---\n{self.stdout[-3000:]}"
            f"\n--- stderr (end) ---\n{self.stderr[-3000:]}\n--- traceback ---\n{self.error}"
        )


class RecordRefused(RuntimeError):
    """A smoke run asked print_and_record to write under benchmarks/results/."""


def _guarded_record() -> Any:
    """benchmarks/record.py as a fresh module whose print_and_record refuses a record under benchmarks/results/."""
    spec = importlib.util.spec_from_file_location("record", BENCHMARKS / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    unguarded = module.print_and_record

    def print_and_record(lines: list[str], record: Path | None) -> None:
        if record is not None and Path(record).resolve().is_relative_to(RESULTS.resolve()):
            raise RecordRefused(
                f"a smoke run asked to append to {record}: smoke runs record nothing (pass record=None "
                "through record.smoke_mode)"
            )
        unguarded(lines, record)

    module.print_and_record = print_and_record
    return module


def _modeling_bindings() -> list[tuple[Any, str, Any]]:
    """(module, name, function) of every Gated DeltaNet kernel global that bind_backend/use_backend rebind."""
    return [
        (module, name, getattr(module, name))
        for module in backends._loaded_modeling_modules()
        for name in backends.ROLE_NAMES.values()
        if hasattr(module, name)
    ]


def _logger_state() -> dict[str, tuple]:
    loggers = {"": logging.getLogger()} | {
        name: logger for name, logger in logging.Logger.manager.loggerDict.items() if isinstance(logger, logging.Logger)
    }
    return {
        name: (logger, logger.level, list(logger.handlers), logger.propagate, logger.disabled)
        for name, logger in loggers.items()
    }


def _restore_loggers(saved: dict[str, tuple]) -> None:
    for logger, level, handlers, propagate, disabled in saved.values():
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate, logger.disabled = propagate, disabled
    for name, logger in logging.Logger.manager.loggerDict.items():  # loggers the run created: no handlers of its own
        if name not in saved and isinstance(logger, logging.Logger):
            logger.handlers[:] = [h for h in logger.handlers if isinstance(h, logging.NullHandler)]


@contextlib.contextmanager
def isolated(script: Path, argv: Sequence[str]) -> Iterator[None]:
    """Run the body as `python script argv...` would see the process, and undo what it changed after."""
    saved_argv, saved_path, saved_cwd, saved_env = sys.argv[:], sys.path[:], os.getcwd(), dict(os.environ)
    saved_modules = set(sys.modules)
    torch_state = (
        torch.get_num_threads(),
        torch.get_default_dtype(),
        torch.get_default_device(),
        torch.get_rng_state(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.is_grad_enabled(),
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.is_anomaly_enabled(),
    )
    rng_state = (random.getstate(), np.random.get_state())
    kernels, bound = _modeling_bindings(), backends._bound
    loggers, logging_disabled = _logger_state(), logging.root.manager.disable
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    gc_state = (list(gc.callbacks), gc.get_threshold(), gc.isenabled())
    try:
        with warnings.catch_warnings():
            sys.argv = [str(script), *argv]
            sys.path.insert(0, str(script.parent))  # as `python script` puts the script's folder first
            sys.modules["record"] = _guarded_record()
            os.chdir(ROOT)
            # what the subprocess form set: the package on the path (for the scripts' own child processes) and
            # one OpenMP thread (two processes' spin-waiting threads on 2 cores cost extract_speed 5x its CPU)
            os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), saved_env.get("PYTHONPATH", "")])
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)
            yield
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        for name in set(sys.modules) - saved_modules:  # the benchmark siblings it imported: fresh for the next one
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if name == "record" or Path(origin).resolve().is_relative_to(script.parent.resolve()):
                del sys.modules[name]
        (
            threads,
            dtype,
            device,
            rng,
            deterministic,
            warn_only,
            grad,
            precision,
            cudnn_benchmark,
            cudnn_deterministic,
            anomaly,
        ) = torch_state
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        if torch.get_default_device() != device:  # setting "cpu" would install a device mode where none was
            torch.set_default_device(None if device == torch.device("cpu") else device)
        torch.set_rng_state(rng)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_grad_enabled(grad)
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = cudnn_benchmark, cudnn_deterministic
        torch.autograd.set_detect_anomaly(anomaly)
        random.setstate(rng_state[0])
        np.random.set_state(rng_state[1])
        for module, name, function in kernels:
            setattr(module, name, function)
        backends._bound = bound
        _restore_loggers(loggers)
        logging.disable(logging_disabled)
        for number, handler in handlers.items():
            signal.signal(number, handler)
        gc.callbacks[:] = gc_state[0]
        gc.set_threshold(*gc_state[1])
        (gc.enable if gc_state[2] else gc.disable)()
        gc.collect()  # the run's models and tensors, before the next one builds its own


def _cpu() -> tuple[float, float]:
    """CPU seconds so far of this process and of its waited-for children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@contextlib.contextmanager
def _captured() -> Iterator[tuple[io.TextIOBase, io.TextIOBase]]:
    """stdout and stderr into two temporary files, at the file descriptors too: the script's child processes and
    forked jobs (multi_gpu_scaling's) write there as well, so a failure message shows their tracebacks."""
    files = tuple(tempfile.TemporaryFile("w+", buffering=1, encoding="utf-8", errors="replace") for _ in range(2))
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        with contextlib.redirect_stdout(files[0]), contextlib.redirect_stderr(files[1]):
            yield files
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def _text(file: io.TextIOBase) -> str:
    file.flush()
    file.seek(0)
    text = file.read()
    file.close()
    return text


def run_in_process(script: Path, argv: Sequence[str] = ("--smoke",)) -> SmokeRun:
    """`python script argv...` as `__main__` in this process, isolated (see `isolated`); never raises."""
    code, error = 0, ""
    started, cpu = time.perf_counter(), _cpu()
    with isolated(script, argv), _captured() as (out, err):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as done:  # as the interpreter turns it into an exit status
            if isinstance(done.code, int):
                code = done.code
            elif done.code is not None:
                code, error = 1, str(done.code)
        except Exception:  # the script's failure, reported with its traceback (Ctrl-C and pytest's timeout pass)
            code, error = 1, traceback.format_exc()
    own, children = (b - a for a, b in zip(cpu, _cpu()))
    return SmokeRun(script, code, _text(out), _text(err), error, time.perf_counter() - started, own, children)


def run_in_subprocess(script: Path, argv: Sequence[str] = ("--smoke",), timeout: float = 900) -> SmokeRun:
    """The fallback: `python script argv...` in a fresh process (its own imports: seconds of CPU more)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    started, cpu = time.perf_counter(), _cpu()
    done = subprocess.run(
        [sys.executable, str(script), *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    own, children = (b - a for a, b in zip(cpu, _cpu()))
    return SmokeRun(script, done.returncode, done.stdout, done.stderr, "", time.perf_counter() - started, own, children)


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.support.benchmark_runner [--subprocess] [NAME ...]`: every smoke (or the named ones) in one process
    (or each in its own, the form before issue 27's runner), a table of wall and CPU seconds; exit 1 if one failed."""
    args = sys.argv[1:] if argv is None else argv
    fresh = "--subprocess" in args
    names = [a for a in args if a != "--subprocess"] or sorted(
        p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in ("record", "multi_gpu_scaling")
    )
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives each fresh process
    print(
        f"| script | {'own process' if fresh else 'in process'}: wall s | CPU s, this process | CPU s, children | ok |"
    )
    print("|---|---:|---:|---:|---|")
    failed = 0
    for name in names:
        done = (run_in_subprocess if fresh else run_in_process)(BENCHMARKS / f"{name}.py")
        failed += done.code != 0
        print(
            f"| {name} | {done.seconds:.1f} | {done.cpu_s:.1f} | {done.children_cpu_s:.1f} | "
            f"{'yes' if done.code == 0 else 'NO'} |",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
