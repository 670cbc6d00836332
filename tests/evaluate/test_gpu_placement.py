"""GPU claim records and their check, without a GPU: injected device lists, real processes and real lock files."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from dflash_eval.cli import main
from dflash_eval.errors import DflashEvalError
from dflash_eval.evaluate import placement

# One evaluation stand-in (torch-free, so it starts in a fraction of a second): claims a GPU among the injected ones, records it, holds it `hold` seconds, exits.
CLAIM = textwrap.dedent("""
    import sys, time
    from dflash_eval.evaluate.gpu import claim_gpu
    gpus, locks, record, hold = sys.argv[1].split(","), sys.argv[2], sys.argv[3], float(sys.argv[4])
    index = claim_gpu(None, "cuda", gpus, locks, poll_s=0.01, record=record, job=record)
    print(f"cuda:{index}", flush=True)
    time.sleep(hold)
""")


def _claim(tmp_path, name, gpus="GPU-a,GPU-b", hold=0.0, locks="locks"):
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            CLAIM,
            gpus,
            str(tmp_path / locks),
            str(tmp_path / "records" / f"{name}.gpu.json"),
            str(hold),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"},
    )


def test_a_claim_records_the_gpu_the_process_and_its_interval(tmp_path):
    process = _claim(tmp_path, "one")
    assert process.communicate(timeout=60)[0].strip() == "cuda:0"
    record = json.loads((tmp_path / "records" / "one.gpu.json").read_text())
    assert (record["device"], record["index"], record["gpu"]) == ("cuda:0", 0, "GPU-a")
    assert record["pid"] == process.pid and record["cuda_visible_devices"] == "0,1"
    assert record["lock"] == str(tmp_path / "locks" / "GPU-a.lock")
    assert record["start"] <= record["end"]  # the end is written as the process exits


def test_a_killed_job_leaves_a_claim_without_end_and_the_check_says_so(tmp_path):
    process = _claim(tmp_path, "killed", hold=60)
    assert process.stdout.readline().strip() == "cuda:0"
    process.send_signal(signal.SIGKILL)
    process.wait()
    check = placement.check_placements(placement.read_records([tmp_path / "records"]))
    assert not check.ok and len(check.unfinished) == 1 and "killed.gpu.json" in check.unfinished[0]


def test_concurrent_processes_never_share_a_gpu_and_run_two_at_once(tmp_path):
    processes = [_claim(tmp_path, f"job{i}", hold=0.4) for i in range(6)]
    devices = [p.communicate(timeout=120)[0].strip() for p in processes]
    assert sorted(set(devices)) == ["cuda:0", "cuda:1"]
    check = placement.check_placements(placement.read_records([tmp_path / "records"]))
    assert check.ok, check
    assert check.peak == 2 and sum(check.jobs_per_gpu.values()) == 6
    assert set(check.jobs_per_gpu) == {f"{os.uname().nodename}/GPU-a", f"{os.uname().nodename}/GPU-b"}


def test_without_shared_locks_the_check_sees_the_overlap(tmp_path):
    """The negative control: two jobs whose lock folders differ both take GPU-a, and the records show it."""
    processes = [_claim(tmp_path, f"job{i}", gpus="GPU-a", hold=0.5, locks=f"locks{i}") for i in range(2)]
    assert [p.communicate(timeout=60)[0].strip() for p in processes] == ["cuda:0", "cuda:0"]
    check = placement.check_placements(placement.read_records([tmp_path / "records"]))
    assert len(check.overlaps) == 1 and check.peak == 2 and not check.ok


def _record(file, gpu, start, end, host="h"):
    return {"file": file, "device": "cuda:0", "gpu": gpu, "host": host, "start": start, "end": end}


def test_the_check_on_hand_made_intervals():
    records = [
        _record("a", "G0", 0, 10),
        _record("b", "G0", 10, 20),  # handed over at t=10: not an overlap
        _record("c", "G1", 5, 15),
        _record("d", "G0", 5, 15, host="other"),  # another host's G0
        {"file": "e", "device": "cpu", "start": 0, "end": 0},
    ]
    check = placement.check_placements(records)
    assert check.ok and check.peak == 3 and check.cpu_jobs == 1 and check.span_s == 20
    assert check.jobs_per_gpu == {"h/G0": 2, "h/G1": 1, "other/G0": 1}
    check = placement.check_placements([_record("a", "G0", 0, 10), _record("b", "G0", 9.5, 20)])
    assert check.overlaps == ["h/G0: b started at 9.500, before a ended at 10.000"] and check.peak == 2


def test_the_command_checks_a_folder_and_the_expected_peak(tmp_path, capsys):
    (tmp_path / "x" / "a.gpu.json").parent.mkdir()
    for name, start in (("a", 0), ("b", 1)):
        (tmp_path / "x" / f"{name}.gpu.json").write_text(json.dumps(_record(name, "G0", start, start + 0.5)))
    assert main(["gpu-placements", str(tmp_path / "x"), "--expect-peak", "1", "--json", str(tmp_path / "c.json")]) == 0
    assert "| h/G0 | 2 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "c.json").read_text())["peak"] == 1
    assert main(["gpu-placements", str(tmp_path / "x"), "--expect-peak", "2"]) == 2
    (tmp_path / "x" / "b.gpu.json").write_text(json.dumps(_record("b", "G0", 0.2, 1)))
    assert main(["gpu-placements", str(tmp_path / "x")]) == 2
    assert "OVERLAP" in capsys.readouterr().out


def test_a_broken_record_is_named(tmp_path):
    (tmp_path / "bad.gpu.json").write_text("{")
    with pytest.raises(DflashEvalError, match=r"bad.gpu.json: not a GPU claim record .*delete it and rerun"):
        placement.read_records([tmp_path])
    with pytest.raises(DflashEvalError, match="nope: no such file or folder"):
        placement.read_records([tmp_path / "nope"])


def test_nvidia_smi_lines_and_a_sampler_on_a_stand_in(tmp_path):
    assert placement.parse_nvidia_smi("0, GPU-1a, 97, 40000\n1, GPU-2b, [N/A], 12\n") == [
        {"index": 0, "uuid": "GPU-1a", "util": 97.0, "mem_mib": 40000.0},
        {"index": 1, "uuid": "GPU-2b", "util": None, "mem_mib": 12.0},
    ]
    with pytest.raises(DflashEvalError, match="unexpected nvidia-smi line"):
        placement.parse_nvidia_smi("0, GPU-1a, 97")
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '0, GPU-1a, 80, 1'\necho '1, GPU-2b, 20, 1'\n")
    fake.chmod(0o755)
    with placement.UtilisationSampler(interval_s=0.01, command=[str(fake)]) as sampler:
        while len(sampler.samples) < 3 and sampler.error is None:
            pass
    assert sampler.error is None and sampler.mean_utilisation() == {0: 80.0, 1: 20.0}
    assert placement.UtilisationSampler(command=[str(tmp_path / "absent")]).error.endswith("is not on PATH")
