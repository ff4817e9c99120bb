"""`benchmarks/processes.py`: the CPU and memory a block of work costs, by kind of process."""

import math

import pytest

from clipstream.benchmarks import processes


@pytest.mark.component
def test_job_cost_counts_the_cpu_of_this_process_and_its_ray_workers_not_other_processes():
    import json
    import subprocess
    import sys

    # in a fresh process: this one's children include the suite's own Ray workers, which JobCost would count
    probe = """
import json, subprocess, sys, time
from clipstream.benchmarks import processes
busy = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.0: pass\\ntime.sleep(0.5)\\n"
with processes.JobCost() as cost:
    tic = time.process_time()
    while time.process_time() - tic < 0.3:  # this process: counted
        pass
    subprocess.run([sys.executable, "-c", busy], check=True)  # a child that is not a ray:: worker: not counted
print(json.dumps([cost.cpu_s, cost.peak_mib]))
"""
    cpu_s, peak_mib = json.loads(subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                                                text=True).stdout.splitlines()[-1])
    assert 0.25 < cpu_s < 0.8  # (with the sampling's own)
    assert peak_mib is None or math.isnan(peak_mib)  # no Ray Train worker started


def test_job_cost_names_each_process_it_counts():
    cost = processes.JobCost()
    cost._cpu = {(1, 0.0): [0.0, 2.0], (2, 0.0): [1.0, 4.0], (3, 0.0): [0.0, 1.0]}
    cost._titles = {(1, 0.0): "driver", (2, 0.0): "RayTrainWorker", (3, 0.0): "RayTrainWorker"}
    assert cost.cpu_by_process == {"RayTrainWorker": 4.0, "driver": 2.0}


def test_a_ray_process_is_named_by_its_kind_and_a_task_worker_by_the_work_it_did():
    assert processes.process_kind("ray::TrainController.run") == "TrainController"
    assert processes.process_kind("ray::RayTrainWorker") == "RayTrainWorker"
    assert processes.process_kind("ray::ReadPandasJSON->SplitBlocks(4)") == "Ray Data tasks"
    assert processes.process_kind("ray::MapBatches(_prepare)") == "Ray Data tasks"
    # between tasks the worker is titled IDLE: its CPU stays with what it ran, and one never seen working is IDLE
    assert processes.process_kind("ray::IDLE", "Ray Data tasks") == "Ray Data tasks"
    assert processes.process_kind("ray::IDLE") == "IDLE"
