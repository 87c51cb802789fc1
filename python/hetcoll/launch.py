"""Launch local ranks: torch.distributed (gloo) workers in processes, or an MPI job by mpiexec.

Used by ``hetcoll demo``, the benchmarks and the multi-process tests; handy for users who want to
try a distributed job on one machine before they book a cluster. Results and errors come back to
the caller: a rank that raises makes :func:`spawn` raise with that rank's traceback, and a rank
that hangs past ``timeout`` is killed and reported with where it was, never waited on forever.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any


class RankFailed(RuntimeError):
    """One or more ranks of a local launch raised, crashed or timed out."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    timeout_s: float,
    threads: int,
    args: tuple[Any, ...],
    result_path: str,
    environ: dict[str, str],
) -> None:
    # The parent's environment as it is now (a forked rank starts from the server's, taken
    # when the server started).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=str(threads),
    )
    # Where this rank is, written when spawn is about to kill it (a timeout, an interrupted
    # caller): faulthandler writes every thread's Python stack from its signal handler, so a
    # rank blocked in a collective or a kernel still says where. The file stays open for it.
    if _STACK_SIGNAL is not None:
        stacks = open(result_path + ".stack", "w")  # noqa: SIM115
        faulthandler.register(_STACK_SIGNAL, file=stacks, all_threads=True)
    outcome: tuple[str, Any]
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend is None:  # fn makes its own group from the environment, and leaves it
            outcome = ("ok", fn(rank, world_size, *args))
        else:
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            try:
                outcome = ("ok", fn(rank, world_size, *args))
                dist.barrier()  # no rank leaves while a peer may still talk to it
            finally:
                # A rank that raised leaves at once: its peers, waiting on it, see the
                # connection close and fail now rather than at the group's timeout.
                dist.destroy_process_group()
    except BaseException as e:  # every failure goes back to the parent
        outcome = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(result_path, "wb") as f:
        pickle.dump(outcome, f)


#: What the rank server imports once, so that no rank pays it: torch, and what a training rank
#: loads on first use: torch.compile's tracer (torch.optim loads it at the first optimizer
#: made, about a second on a 2-core host) and hetcoll's torch integration. None of them
#: starts a thread or initialises MPI, so forking after them is safe.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "hetcoll.torch")

#: What the rank server also imports for each of these modules the caller has already
#: imported when the server starts (at the first :func:`spawn`): the module that loads a model
#: library's models (torchvision's package does; Hugging Face's transformers loads them lazily,
#: and its modeling base costs a rank about 1.5 s on a 2-core host, on top of the above), which
#: a caller that loaded the library likely builds its ranks' models from; and the training
#: loops a caller that loaded them likely runs in its ranks: Accelerate, and transformers'
#: Trainer (about 2 s more a rank). A caller that never imported them does not pay for them.
#: None of them starts a thread at import.
PRELOAD_IF_LOADED = {
    "torchvision": "torchvision",
    "transformers": "transformers.modeling_utils",
    "transformers.trainer": "transformers.trainer",
    "accelerate": "accelerate",
}


def preloaded() -> list[str]:
    """The modules the rank server imports once, were it to start now: :data:`PRELOAD`, and
    :data:`PRELOAD_IF_LOADED`'s for the modules this process has imported."""
    return [*PRELOAD, *(m for mod, m in PRELOAD_IF_LOADED.items() if mod in sys.modules)]


def _context(mp: Any) -> Any:
    """Where ranks start: forked from a server that imported torch once (``forkserver``, where
    the platform has it: importing torch takes seconds, a fork milliseconds), else fresh
    interpreters (``spawn``). Either way ``fn`` runs in a process of its own that holds
    nothing of the caller's state but its arguments (the server never runs a rank's code)."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preloaded())
    return ctx


#: Seconds :func:`spawn` allows its ranks to start (the rank server's imports at its first
#: call, fresh interpreters where there is no fork server) on top of ``timeout``.
_START_SLACK_S = 60.0

#: The signal on which a rank of :func:`spawn` writes its Python stacks before it is killed
#: (None where the platform has no SIGUSR1).
_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)


def _stacks(procs: list[Any], paths: list[str]) -> list[str]:
    """Each living rank's Python stacks, by position ("" for one gone, or that wrote none):
    asked of all at once, before any is killed, so that each is where the hang left it."""
    alive = [i for i, p in enumerate(procs) if p.is_alive()]
    if _STACK_SIGNAL is None or not alive:
        return [""] * len(procs)
    for i in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[i].pid, _STACK_SIGNAL)
    files = {i: paths[i] + ".stack" for i in alive}

    def started(path: str) -> bool:
        try:
            return os.path.getsize(path) > 0
        except OSError:
            return False

    deadline = time.monotonic() + 2.0  # the handlers write at once; a rank in C code, soon
    while time.monotonic() < deadline and not all(map(started, files.values())):
        time.sleep(0.05)
    time.sleep(0.1)  # the rest of a long stack
    found = [""] * len(procs)
    for i, path in files.items():
        with contextlib.suppress(OSError):
            found[i] = Path(path).read_text()
    return found


def _kill(procs: list[Any]) -> None:
    """Kill these rank processes (and their own children: loader workers, which a killed rank
    leaves behind) and wait for them."""
    for p in procs:
        if not p.is_alive():  # gone: its pid may be another process's by now
            p.join()
            continue
        for child in _children(p.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        p.kill()
        p.join()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, where the platform lists them (Linux's /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _check_timeout(timeout: object) -> None:
    """``timeout``: a finite number of seconds > 0; ``ValueError`` naming it otherwise."""
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout <= sys.float_info.max
    ):
        raise ValueError(f"timeout: must be a finite number of seconds > 0, got {timeout!r}")


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = "gloo",
    timeout: float = 120.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes of their own joined in
    one torch.distributed process group; return each rank's result, in rank order. Each rank
    sees the caller's environment and working directory as they are at the call, and the
    variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``...). On Linux and macOS the ranks fork from a server process that imported
    torch at the first call, so later calls start their ranks in milliseconds rather than
    seconds (elsewhere each rank is a fresh interpreter).

    ``backend``: the group's (``"gloo"``, ``"nccl"``, ...), or None for no group made here:
    ``fn`` makes its own from those variables, as a script launched by torchrun does
    (``dist.init_process_group()``, or Accelerate's and Trainer's own), and leaves it
    (:func:`run_script`).

    ``fn`` must be importable (defined at module level). A rank that raises or dies makes this
    raise :class:`RankFailed` naming it; ranks still running after ``timeout`` seconds are killed,
    the error giving each one's Python stacks at that moment (where it hung).

    >>> spawn(my_fn, 2)  # doctest: +SKIP
    """
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: must be an integer >= 1, got {world_size!r}")
    _check_timeout(timeout)
    if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int):
        raise TypeError(f"threads_per_rank: must be an integer >= 1, got {threads_per_rank!r}")
    if threads_per_rank < 1:
        raise ValueError(f"threads_per_rank: must be an integer >= 1, got {threads_per_rank!r}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(
            f"backend: must be a torch.distributed backend's name or None, got {backend!r}"
        )
    ctx = _context(mp)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="hetcoll-spawn-") as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    r,
                    world_size,
                    port,
                    backend,
                    timeout,
                    threads_per_rank,
                    args,
                    paths[r],
                    dict(os.environ),
                ),
                daemon=False,
            )
            for r in range(world_size)
        ]
        # One shared deadline (plus start-up slack) for all ranks.
        deadline = time.monotonic() + timeout + _START_SLACK_S
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        except BaseException:
            # Interrupted (Ctrl-C, a test's own timeout): the ranks go too, else the caller's
            # exit waits for them (multiprocessing joins its children at exit), for ever if
            # they wait on one another. Where each was goes to stderr first.
            for r, where in enumerate(_stacks(procs, paths)):
                if where:
                    print(
                        f"hetcoll.launch.spawn interrupted; rank {r} was at:\n{where}",
                        file=sys.stderr,
                    )
            _kill([p for p in procs if p.pid is not None])
            raise
        failures = []
        stacks = _stacks(procs, paths)
        for r, p in enumerate(procs):
            if p.is_alive():
                _kill([p])
                where = f"; it was at:\n{stacks[r].rstrip()}" if stacks[r] else ""
                failures.append(f"rank {r}: still running after {timeout:.0f} s, killed{where}")
        results: list[Any] = []
        for r, (p, path) in enumerate(zip(procs, paths)):
            if not os.path.exists(path):
                if not any(f.startswith(f"rank {r}:") for f in failures):
                    failures.append(f"rank {r}: exited with code {p.exitcode} and no result")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                failures.append(f"rank {r}: {value}")
            results.append(value)
        if failures:
            raise RankFailed("\n".join(failures))
        return results


def _script(rank: int, world_size: int, path: str, argv: list[str]) -> None:
    """A rank of :func:`run_script`: ``path`` run as ``__main__`` with ``argv``."""
    import runpy

    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as `python path` puts it
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:  # sys.exit(0) or sys.exit() is a script's success
        if e.code not in (0, None):
            raise


def run_script(
    path: str | os.PathLike[str],
    world_size: int,
    argv: Sequence[str] = (),
    *,
    timeout: float = 300.0,
    threads_per_rank: int = 1,
) -> None:
    """Run the training script ``path`` with arguments ``argv`` on ``world_size`` local ranks,
    as ``torchrun --standalone --nproc-per-node=world_size path argv...`` does: each rank runs
    it as ``__main__``, ``sys.argv`` set and torchrun's variables in its environment (the
    script makes its process group from them), with its ranks forked from :func:`spawn`'s
    server instead of fresh interpreters: no interpreter start and no import of torch a rank,
    for a quick try of a script on one machine. A rank that raises, exits with a non-zero
    code or outlasts ``timeout`` seconds makes it raise :class:`RankFailed`, as :func:`spawn`
    does. The ranks write to the standard output and error this process had when the server
    started (its first :func:`spawn`): a caller that reads what a script prints launches it
    with torchrun instead.

    >>> run_script("train.py", 2, ["--epochs", "1"])  # doctest: +SKIP
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: no such script: {path!r}")
    if isinstance(argv, str) or not all(isinstance(a, str) for a in argv):
        raise TypeError(f"argv: must be a sequence of strings, got {argv!r}")
    spawn(
        _script,
        world_size,
        path,
        list(argv),
        backend=None,
        timeout=timeout,
        threads_per_rank=threads_per_rank,
    )


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), where the platform lists them."""
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = _children(todo.pop())
        found.extend(kids)
        todo.extend(kids)
    return found


def _stop_python_ranks(pid: int) -> int:
    """Abort the Python processes below ``pid`` (an MPI job's ranks, this interpreter's kind),
    each writing its Python stacks to its stderr as it goes (``PYTHONFAULTHANDLER``), and
    leaving no core file; returns how many. The job's other processes (mpiexec, its proxies)
    are paused meanwhile: the first rank to die would make them kill the others before those
    had written where they were."""
    python = os.path.realpath(sys.executable)
    ranks: list[int] = []
    others = [pid]
    for child in _descendants(pid):
        try:
            (ranks if os.path.realpath(f"/proc/{child}/exe") == python else others).append(child)
        except OSError:  # gone meanwhile
            continue
    _signal_all(others, signal.SIGSTOP)
    try:
        for rank in ranks:
            with contextlib.suppress(ImportError, AttributeError, OSError):  # Linux has it
                import resource

                resource.prlimit(rank, resource.RLIMIT_CORE, (0, 0))
        _signal_all(ranks, signal.SIGABRT)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(map(_running, ranks)):
            time.sleep(0.05)
    finally:
        _signal_all(others, signal.SIGCONT)
    return len(ranks)


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (neither gone nor a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_session(job: subprocess.Popen[str]) -> None:
    """Kill a job started in a session of its own (every process in it) and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(job.pid, signal.SIGKILL)
    job.kill()
    job.communicate()


def mpiexec_path() -> str:
    """The ``mpiexec`` next to this Python (a venv with the ``mpich`` wheel), else on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError(
            "mpiexec: not found next to this Python or on PATH (pip install mpich mpi4py)"
        )
    return found


#: MPICH's settings for more ranks than cores: a rank waiting in a blocking call sleeps
#: between polls (it busy-waits by default). Other MPIs ignore them (Open MPI yields by itself
#: when it sees more ranks than cores).
OVERSUBSCRIBED_MPICH = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "MPIR_CVAR_POLLS_BEFORE_YIELD": "10"}


def mpiexec(
    nprocs: int,
    argv: Sequence[str],
    *,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    capture: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``mpiexec -n nprocs <this python> argv...``; raise :class:`RankFailed` on a non-zero
    exit or after ``timeout`` seconds: then each rank is stopped with its Python stacks written
    to stderr (where it hung), and the job is killed, every process of it.

    With more ranks than this machine's cores, MPICH's waiting ranks yield their core instead
    of spinning on it (:data:`OVERSUBSCRIBED_MPICH`, unless the environment or ``env`` sets
    those variables): a spinning rank takes the core of the rank it waits for."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs: must be an integer >= 1, got {nprocs!r}")
    if isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence):
        raise TypeError(f"argv: must be a list of str (the script and its arguments), got {argv!r}")
    for i, a in enumerate(argv):
        if not isinstance(a, (str, os.PathLike)):
            raise TypeError(f"argv[{i}]: must be a str or a path, got {type(a).__name__}")
    _check_timeout(timeout)
    if env is not None and (
        not isinstance(env, Mapping)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise TypeError(f"env: must be a dict of str to str, got {env!r}")
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    # A rank that crashes, or that is stopped at the timeout, writes its Python stack first.
    full_env.setdefault("PYTHONFAULTHANDLER", "1")
    if nprocs > (os.cpu_count() or 1):
        for name, value in OVERSUBSCRIBED_MPICH.items():
            full_env.setdefault(name, value)
    full_env.update(env or {})
    cmd = [mpiexec_path(), "-n", str(nprocs), sys.executable, *map(os.fspath, argv)]
    pipe = subprocess.PIPE if capture else None
    # A session of its own: the whole job (mpiexec, its proxies, the ranks) is killed at once.
    job = subprocess.Popen(
        cmd, env=full_env, stdout=pipe, stderr=pipe, text=True, start_new_session=True
    )
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stopped = _stop_python_ranks(job.pid)
        try:  # the stopped ranks' stacks, through mpiexec's stderr
            stdout, stderr = job.communicate(timeout=10.0)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", ""
        _kill_session(job)
        where = f"; {stopped} rank(s) stopped with their Python stacks (stderr)" if stopped else ""
        raise RankFailed(
            f"{' '.join(cmd)}: still running after {timeout:.0f} s, killed{where}\n"
            f"--- stdout ---\n{stdout or ''}\n--- stderr ---\n{stderr or ''}"
        ) from None
    except BaseException:  # interrupted: the job goes too
        _kill_session(job)
        raise
    proc = subprocess.CompletedProcess(cmd, job.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise RankFailed(
            f"{' '.join(cmd)} exited with code {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    return proc
