"""Scale-out with torch.distributed: results identical to a single process.

One worker script is run as a plain single process and as 2 and 3 processes of one gloo
group with torchrun's environment (``tests/launch.py``; one thread each, 127.0.0.1
only). It measures 5 batches of one model (worst case, deterministic and random start;
average case) with ``distributed=True`` and a population of 4 models with
``map_population``; rank 0 writes everything to JSON. The files must be byte-identical
across the three runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import geosharp
from launch import free_port, run_python
from zoo import encoder_case

TESTS = Path(__file__).resolve().parent

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[2])
    torch.set_num_threads(1)
    import geosharp
    from geosharp import distributed as gd
    from zoo import encoder_case

    rank, world = gd.init()
    case = encoder_case(dtype=torch.float64)
    batches = [case.batches[i % len(case.batches)] for i in range(5)]
    settings = {
        "worst": dict(measure="geodesic-inv", rho=0.05, estimator=geosharp.WorstCase(4)),
        "worst-random": dict(measure="adaptive", rho=0.05, seed=3,
                             estimator=geosharp.WorstCase(3, starts="random")),
        "average": dict(measure="geodesic-mix", rho=0.01, seed=5,
                        estimator=geosharp.AverageCase(n_samples=2)),
    }
    results = {
        name: geosharp.sharpness(case.model, batches, case.loss_fn,
                                 distributed=gd.is_distributed(), **kw).to_dict()
        for name, kw in settings.items()
    }

    def measure(seed):
        model = encoder_case(dtype=torch.float64, seed=seed)
        r = geosharp.sharpness(model.model, model.batches[:1], model.loss_fn,
                               "geodesic-mix", 0.01, geosharp.WorstCase(n_iters=3))
        return {"seed": seed, "rank": None, **r.to_dict()}

    population = gd.map_population([0, 1, 2, 3], measure, out=sys.argv[1] + "/population.json")
    assert len(population) == 4
    if rank == 0:
        gd.write_json_atomic(sys.argv[1] + "/batches.json", results)
        with open(sys.argv[1] + "/world.txt", "w") as f:
            f.write(str(world))
    """
)


def run_worker(tmp_path: Path, nproc: int) -> Path:
    out = tmp_path / f"world{nproc}"
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run_python([str(script), str(out), str(TESTS)], nproc, timeout=300)
    assert (out / "world.txt").read_text() == str(nproc)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distributed")
    return {n: run_worker(tmp, n) for n in (1, 2, 3)}


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("name", ["batches.json", "population.json"])
def test_results_identical_to_a_single_process(runs, nproc, name):
    single = (runs[1] / name).read_bytes()
    assert single.strip()
    assert (runs[nproc] / name).read_bytes() == single


def test_single_process_file_matches_plain_sharpness(runs):
    """The single-process run of the worker is plain geosharp: same numbers as here."""
    import json

    case = encoder_case(dtype=torch.float64)
    batches = [case.batches[i % len(case.batches)] for i in range(5)]
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        r = geosharp.sharpness(
            case.model,
            batches,
            case.loss_fn,
            geosharp.Geometry.named("geodesic", metric="inv"),
            rho=0.05,
            estimator=geosharp.WorstCase(n_iters=4),
        )
    stored = json.loads((runs[1] / "batches.json").read_text())["worst"]
    assert stored["per_batch"] == pytest.approx(r.per_batch, rel=1e-12)


def test_distributed_needs_a_process_group():
    case = encoder_case(dtype=torch.float64)
    with pytest.raises(RuntimeError, match="process group"):
        geosharp.sharpness(case.model, case.batches, case.loss_fn, distributed=True)


def test_helpers_without_a_group(tmp_path):
    from geosharp import distributed as gd

    assert gd.rank_and_world() == (0, 1)
    assert not gd.is_distributed()
    assert list(gd.shard(5)) == [0, 1, 2, 3, 4]
    assert gd.gather_in_order([(2, "b"), (0, "a")]) == [(0, "a"), (2, "b")]
    out = gd.map_population(["x", "yy"], len, out=tmp_path / "sub" / "pop.json")
    assert out == [1, 2]
    assert (tmp_path / "sub" / "pop.json").read_text() == "[\n  1,\n  2\n]\n"
    assert not list((tmp_path / "sub").glob(".*tmp"))


def test_the_group_is_destroyed_before_the_interpreter_exits(tmp_path):
    """A gloo group left to the interpreter's teardown aborted about 1 in 5 finished
    two-process runs (``terminate called without an active exception``), so ``init``
    destroys its group at exit. A hook registered before ``init`` runs after its own
    (``atexit`` is last in, first out) and sees the group gone."""
    script = tmp_path / "hello.py"
    script.write_text(
        "import atexit, sys\n"
        "import torch.distributed as dist\n"
        "from geosharp import distributed as gd\n"
        "atexit.register(lambda: print('still up at exit:', dist.is_initialized()))\n"
        "print(gd.init())\n"
    )
    env = {
        **os.environ,
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n") == ["(0, 1)", "still up at exit: False", ""]


@pytest.mark.parametrize("torchrun", [True, False], ids=["torchrun", "forked"])
@pytest.mark.parametrize("how", ["raises", "usage error"])
def test_a_failing_process_does_not_hold_the_others(tmp_path, how, torchrun):
    """A process that fails while another waits for it in a collective leaves at once
    (no barrier at exit, which would wait for the waiting one forever): the other fails
    on the closed connection and the launch ends, well within its time limit; under
    torchrun and as the tests' launcher forks the processes."""
    from launch import launch

    script = tmp_path / "fail.py"
    script.write_text(
        "import sys\n"
        "import torch.distributed as dist\n"
        "from geosharp import distributed as gd\n"
        "from geosharp.cli import main\n"
        "rank, _ = gd.init()\n"
        "if rank == 1:\n"
        f"    if {how == 'raises'}:\n"
        "        raise AssertionError('process 1 fails')\n"
        "    sys.exit(main(['measure', 'no/such/checkpoint', '--data', 'digits']))\n"
        "dist.broadcast_object_list([None], src=1)  # waits for process 1\n"
    )
    proc = launch([str(script)], 2, timeout=90, torchrun=torchrun)
    assert proc.returncode != 0
    said = "process 1 fails" if how == "raises" else "geosharp: error:"
    assert said in proc.stderr, proc.stderr[-2000:]


def test_a_forked_process_sees_what_python_would(tmp_path):
    """The launcher's forked processes get the arguments, module search path, working
    directory, ``__name__`` and environment of ``python ARGS`` (a script, and ``-m``),
    torchrun's variables for several processes, and their outputs in rank order."""
    import json

    from launch import environment, launch

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    show = (
        "import json, os, sys\n"
        "keys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'OMP_NUM_THREADS', 'EXTRA')\n"
        "print(json.dumps([sys.argv, sys.path, os.getcwd(), __name__,\n"
        "                  {k: os.environ.get(k) for k in keys}]))\n"
    )
    (tmp_path / "pkg" / "show.py").write_text(show)
    (tmp_path / "here").mkdir()
    env = environment({"EXTRA": "1"})
    for args in ([str(tmp_path / "pkg" / "show.py"), "a", "--b"], ["-m", "pkg.show", "a"]):
        cwd = tmp_path if args[0] == "-m" else tmp_path / "here"
        plain = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
                               text=True, check=True)  # fmt: skip
        forked = launch(args, 1, cwd=cwd, env={"EXTRA": "1"})
        assert forked.returncode == 0, forked.stderr
        assert json.loads(forked.stdout) == json.loads(plain.stdout)
    many = launch([str(tmp_path / "pkg" / "show.py")], 3, env={"EXTRA": "1"})
    ranks = [json.loads(line)[4] for line in many.stdout.splitlines()]
    assert [(r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"]) for r in ranks] == [
        (str(r), str(r), "3") for r in range(3)
    ]
    assert all(r["MASTER_ADDR"] == "127.0.0.1" and r["EXTRA"] == "1" for r in ranks)
    missing = launch([str(tmp_path / "nope.py")], 1)
    assert missing.returncode != 0 and "nope.py" in missing.stderr
