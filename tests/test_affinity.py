"""CPU pinning of the serving processes (freetoken_core.affinity): the plan, and what
``pin_engine_threads`` / ``release_thread`` do to real threads, in a child process so that
the test run keeps its own CPUs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from freetoken_core.affinity import CpuPlan, plan_cpus

needs_two_cpus = pytest.mark.skipif(plan_cpus() is None,
                                    reason="pinning needs Linux and at least two CPUs")


def test_plan_takes_the_lowest_cpu_for_the_main_thread() -> None:
    assert plan_cpus([5, 3, 9, 4]) == CpuPlan(3, frozenset({4, 5, 9}))
    assert plan_cpus([0, 1]) == CpuPlan(0, frozenset({1}))


def test_one_cpu_has_no_plan() -> None:
    assert plan_cpus([2]) is None
    assert plan_cpus([]) is None


@needs_two_cpus
def test_default_plan_covers_this_process_cpus() -> None:
    plan = plan_cpus()
    assert plan is not None
    assert {plan.main} | plan.shared == os.sched_getaffinity(0)
    assert plan.main not in plan.shared


CHILD = textwrap.dedent("""
    import os, threading, json
    from freetoken_core import affinity

    def affinity_of_new_thread(initializer=None):
        out = {}
        def run():
            if initializer:
                initializer()
            out["cpus"] = sorted(os.sched_getaffinity(0))
        t = threading.Thread(target=run); t.start(); t.join()
        return out["cpus"]

    affinity.release_thread()  # before pinning: changes nothing
    before = sorted(os.sched_getaffinity(0))
    started = threading.Event(); done = threading.Event(); seen = {}
    def early():
        seen["tid"] = threading.get_native_id(); started.set(); done.wait()
    t = threading.Thread(target=early); t.start(); started.wait()
    plan = affinity.plan_cpus()
    affinity.pin_engine_threads(plan)
    result = {
        "before": before, "main": sorted(os.sched_getaffinity(0)),
        "early": sorted(os.sched_getaffinity(seen["tid"])),
        "inherited": affinity_of_new_thread(),
        "released": affinity_of_new_thread(affinity.release_thread),
        "plan": [plan.main, sorted(plan.shared)],
    }
    done.set(); t.join()
    print(json.dumps(result))
""")


@needs_two_cpus
def test_pin_engine_threads_splits_main_from_the_rest() -> None:
    import json

    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    main, shared = r["plan"]
    assert r["before"] == sorted([main, *shared])
    assert r["main"] == [main]
    assert r["early"] == shared  # a thread that existed (like OpenMP's workers)
    assert r["inherited"] == [main]  # a new thread inherits its starter's CPU ...
    assert r["released"] == shared  # ... until it releases itself
