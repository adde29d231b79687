"""Run many named test cases in a few gloo processes on the CPU.

Starting processes and importing torch costs seconds, and the CPU suite runs on small
machines, so the processes of one world size are started ONCE and run every case of
that world size one after the other; each rank writes what happened in each case to its
own log file, and the pytest test functions (one per case, parametrized over the case
names) assert on what was collected.

    from _dist import case, Batch

    @case(worlds=(2, 4))
    def my_case(rank, world):      # runs in every worker process, in the same order
        ...                        # raise to fail; return a JSON value to compare

Each case returns a JSON-serialisable value (or None). ``Batch.outcomes(name)`` gives
the per-rank records: ``ok`` (bool), ``error`` (exception text and traceback) and
``value``. A case that breaks the group (a hang, a crashed rank) cannot hang the suite:
the whole batch has a hard deadline, after which the workers dump their Python stacks
(faulthandler, SIGUSR1) and are killed, and every case that did not finish fails with
a message naming the case each rank was in.

Workers are plain ``python -c`` subprocesses (no fork of the pytest process), with
MASTER_ADDR=127.0.0.1, a free port, OMP_NUM_THREADS=1, and
``dist.init_process_group("gloo", rank=..., world_size=...)``.
"""
import dataclasses
import datetime
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[[int, int], Any]
    worlds: Sequence[int]


CASES: Dict[str, Case] = {}


def case(name: Optional[str] = None, *, worlds: Sequence[int] = (2, 4)):
    """Register ``fn(rank, world) -> JSON value`` as a case run in every worker of each
    world size in ``worlds``. Names must be unique."""

    def deco(fn):
        n = name or fn.__name__
        if n in CASES:
            raise ValueError(f"duplicate case name {n!r}")
        CASES[n] = Case(n, fn, tuple(worlds))
        return fn

    return deco


def case_names(world: int) -> List[str]:
    return [c.name for c in CASES.values() if world in c.worlds]


# --------------------------------------------------------------------------------------
# Parent side


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(worker: str, args: Sequence[str], nproc: int, out_dir, timeout_s: float, log_name: str,
                 **extra_env) -> tuple:
    """Run ``torchrun --nproc_per_node=nproc worker *args`` (the GPU tests' workers) with NVLink
    multicast off, one OpenMP thread, the repository and tests/ on PYTHONPATH and
    FLUX_GPU_RESULTS_DIR=out_dir; kill torchrun and its workers past ``timeout_s``. The whole
    output is kept in out_dir/output.log, and copied to $FLUX_TEST_LOG_DIR/log_name when that is
    set (bench/run_gpu.sh). Returns (exit code, or a string saying it was killed; the output's
    last 8000 characters)."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FLUX_GPU_RESULTS_DIR=str(out_dir),
               PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, TESTS_DIR, os.environ.get("PYTHONPATH")) if p),
               **extra_env)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", worker, *args]
    log_path = os.path.join(str(out_dir), "output.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every worker
            proc.wait()
            rc = f"killed after {timeout_s:.0f} s"
    if os.environ.get("FLUX_TEST_LOG_DIR"):
        import shutil

        os.makedirs(os.environ["FLUX_TEST_LOG_DIR"], exist_ok=True)
        shutil.copy(log_path, os.path.join(os.environ["FLUX_TEST_LOG_DIR"], log_name))
    with open(log_path, errors="replace") as f:
        return rc, f.read()[-8000:]


@dataclasses.dataclass
class Batch:
    world: int
    names: List[str]
    results: Dict[str, List[Optional[dict]]]  # case -> per-rank record (None: never finished)
    where: List[str]  # where each rank was when the batch ended ("in case 'x'", ...)
    failure: Optional[str]  # why the batch ended abnormally, or None
    seconds: float

    def outcomes(self, name: str) -> List[dict]:
        """Per-rank records of case ``name``; fails the calling test (with the batch's
        failure) if some rank did not finish it."""
        import pytest

        if name not in self.results:
            pytest.fail(f"case {name!r} was not run in the world-{self.world} batch")
        recs = self.results[name]
        missing = [r for r, rec in enumerate(recs) if rec is None]
        if missing:
            where = "; ".join(f"rank {r} was {w}" for r, w in enumerate(self.where))
            pytest.fail(f"case {name!r} did not finish on ranks {missing} (world {self.world}). "
                        f"When the batch ended: {where}.\n{self.failure or ''}", pytrace=False)
        return recs  # type: ignore[return-value]

    def assert_ok(self, name: str) -> List[Any]:
        """Fail unless case ``name`` passed on every rank; return the per-rank values."""
        import pytest

        recs = self.outcomes(name)
        bad = [(r, rec["error"]) for r, rec in enumerate(recs) if not rec["ok"]]
        if bad:
            text = "\n".join(f"--- rank {r} ---\n{err}" for r, err in bad)
            pytest.fail(f"case {name!r} failed on ranks {[r for r, _ in bad]} (world {self.world}):\n{text}",
                        pytrace=False)
        return [rec["value"] for rec in recs]


def _read_log(path: str):
    """(records by case, case in progress) from one rank's JSON-lines log."""
    done: Dict[str, dict] = {}
    where = "before the first case (starting up)"
    if not os.path.exists(path):
        return done, where
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut by the kill
                continue
            if rec["event"] == "start":
                where = f"in case {rec['case']!r}"
            elif rec["event"] == "end":
                done[rec["case"]] = rec
                where = f"after case {rec['case']!r}"
            else:
                where = f"after case {rec['after']!r}, waiting for its peers to finish it"
    return done, where


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text[-n:]


def run_batch(module_file: str, world: int, names: Sequence[str], workdir: str, timeout_s: float = 120.0,
              env: Optional[Dict[str, str]] = None) -> Batch:
    """Start ``world`` worker processes that import ``module_file`` (which registers
    cases with ``@case``) and run ``names`` in order; wait at most ``timeout_s`` seconds."""
    os.makedirs(workdir, exist_ok=True)
    names = list(names)
    with open(os.path.join(workdir, "cases.json"), "w") as f:
        json.dump(names, f)
    port = free_port()
    base_env = dict(os.environ)
    base_env.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, TESTS_DIR, os.environ.get("PYTHONPATH")) if p),
    })
    base_env.update(env or {})
    code = "import _dist; _dist._worker_main()"
    procs, errs = [], []
    t0 = time.monotonic()
    for rank in range(world):
        e = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
        err = open(os.path.join(workdir, f"stderr.{rank}"), "w")
        errs.append(err)
        procs.append(subprocess.Popen(
            [sys.executable, "-c", code, module_file, workdir], env=e, cwd=REPO_ROOT,
            stdout=err, stderr=subprocess.STDOUT, start_new_session=True))
    failure = None
    deadline = t0 + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                # One rank died: give its peers a moment to fail on their own, then stop them.
                deadline = min(deadline, time.monotonic() + 15)
            if time.monotonic() > deadline:
                failure = f"the world-{world} batch did not finish within its bound; workers were killed"
                for p in procs:  # Python stacks first (faulthandler is registered on SIGUSR1)
                    if p.poll() is None:
                        try:
                            p.send_signal(signal.SIGUSR1)
                        except ProcessLookupError:
                            pass
                time.sleep(1.0)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                for p in procs:
                    p.wait()
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for err in errs:
            err.close()
    seconds = time.monotonic() - t0
    results: Dict[str, List[Optional[dict]]] = {n: [None] * world for n in names}
    where: List[str] = []
    for rank in range(world):
        done, w = _read_log(os.path.join(workdir, f"log.{rank}"))
        where.append(w)
        for n, rec in done.items():
            if n in results:
                results[n][rank] = rec
    codes = [p.returncode for p in procs]
    if failure is None and any(c != 0 for c in codes):
        failure = f"worker exit codes {codes}"
    if failure is not None:
        where_text = "; ".join(f"rank {r} was {w}" for r, w in enumerate(where))
        tails = "\n".join(f"--- rank {r} output (tail) ---\n{_tail(os.path.join(workdir, f'stderr.{r}'))}"
                          for r in range(world))
        failure = f"{failure} after {seconds:.0f} s (bound {timeout_s:.0f} s): {where_text}.\n{tails}"
    return Batch(world, names, results, where, failure, seconds)


# --------------------------------------------------------------------------------------
# Worker side


def _worker_main() -> None:
    import faulthandler

    module_file, workdir = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(os.path.join(workdir, "cases.json")) as f:
        names = json.load(f)
    spec = importlib.util.spec_from_file_location("_flux_dist_cases", module_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # registers the cases in CASES

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    # The harness's own group: its step between cases can never be matched against a
    # collective that a case left pending on another group, so a rank left behind inside
    # a case shows as a hang in that case (and not as a silent mismatch in a later one).
    sync = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=1))
    log = open(os.path.join(workdir, f"log.{rank}"), "w", buffering=1)
    try:
        for i, name in enumerate(names):
            log.write(json.dumps({"event": "start", "case": name}) + "\n")
            log.flush()
            t = time.monotonic()
            try:
                value = CASES[name].fn(rank, world)
                rec = {"ok": True, "error": None, "value": value}
            except BaseException as e:  # noqa: BLE001  (reported, not swallowed)
                rec = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}", "value": None}
            rec.update(event="end", case=name, seconds=round(time.monotonic() - t, 3))
            try:
                line = json.dumps(rec)
            except (TypeError, ValueError) as e:
                line = json.dumps({"event": "end", "case": name, "ok": False, "value": None,
                                   "error": f"case returned a value that is not JSON: {e}"})
            log.write(line + "\n")
            log.write(json.dumps({"event": "sync", "after": name}) + "\n")
            log.flush()
            steps = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(steps, torch.tensor([i], dtype=torch.int64), group=sync)
            if any(int(t) != i for t in steps):
                raise RuntimeError(f"ranks out of step after case {name!r}: case indices {[int(t) for t in steps]}")
    finally:
        log.close()
    dist.barrier(group=sync)
    dist.destroy_process_group()


def batches(module_file: str, prefix: str, tmp_path_factory, timeout_s: float = 120.0):
    """world -> Batch of the registered cases named ``prefix*``, each world size started once
    (for a module-scoped pytest fixture)."""
    done = {}

    def get(world: int) -> "Batch":
        if world not in done:
            names = [n for n in case_names(world) if n.startswith(prefix)]
            workdir = str(tmp_path_factory.mktemp(f"{prefix.strip('-')}{world}"))
            done[world] = run_batch(module_file, world, names, workdir, timeout_s=timeout_s)
        return done[world]

    return get
