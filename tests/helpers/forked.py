"""A test's command in two processes forked from the test's own, started as ``torchrun --standalone`` starts its
workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, one
thread each), but without its three interpreters: a torchrun launch spends about 11 s of CPU here importing torch,
torchvision and vitlab in each worker and torch in the launcher, before the command does anything.

For the tests of what two processes compute (the numbers of 2 processes against 1). :func:`start` forks one
process so, for the tests whose subject is a command's process (a signal to it, a kill of its group, two at once on
one study) rather than its interpreter. What is torchrun's own (its signals, restarts and exit codes) is tested under
torchrun (test_preemption, test_elastic). Where a fork cannot stand in for a fresh process (a machine with a GPU: the
test's process may have asked CUDA for its devices, and a process launched onto the CPU must hide them before
anything asks; a process group already started in the test's process; a system other than Linux, where forking a
process that has loaded torch is not safe), the command runs under torchrun, or in a fresh interpreter.
"""
from __future__ import annotations

import logging
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]


def run_two(argv: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``python ARGV`` (a script and its arguments, or ``-m vitlab.cli ...``) in 2 processes as torchrun would run
    it: the first failure's exit status, the processes' output one after the other (rank 0's first). A process
    that fails has the other killed, as torchrun does; past ``timeout`` seconds both are, and the status is -9."""
    import torch.distributed as dist

    if sys.platform != "linux" or torch.cuda.is_available() or (dist.is_available() and dist.is_initialized()):
        return subprocess.run([*TORCHRUN_2, *argv], capture_output=True, text=True, env=env, timeout=timeout)
    port = _free_port()
    with tempfile.TemporaryDirectory() as logs:
        outputs = [(Path(logs) / f"{rank}.out", Path(logs) / f"{rank}.err") for rank in range(2)]
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                _child(argv, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                              "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}, *outputs[rank])
            pids.append(pid)
        status = _wait(pids, time.monotonic() + timeout)
        return subprocess.CompletedProcess(argv, status, "".join(out.read_text() for out, _ in outputs),
                                           "".join(err.read_text() for _, err in outputs))


class Forked:
    """``python ARGV`` in one process forked from the test's own, started at once: what ``subprocess.Popen`` gives
    for a command whose process is a test's subject (a signal to it, a kill of its group, two of them at once) but
    whose fresh interpreter is not. Its output goes to files read at the end (:meth:`communicate`)."""

    def __init__(self, argv: list[str], env: dict[str, str], *, cwd: Path | None = None,
                 start_new_session: bool = False):
        self._logs = tempfile.TemporaryDirectory()
        self._out, self._err = Path(self._logs.name) / "out", Path(self._logs.name) / "err"
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            if start_new_session:
                os.setsid()
            if cwd is not None:
                os.chdir(cwd)
            _child(argv, {**env, "OMP_NUM_THREADS": "1"}, self._out, self._err)

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status, once it has exited; ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Waits for the process (killed past ``timeout`` seconds: ``subprocess.TimeoutExpired``); its output."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            raise
        out, err = self._out.read_text(), self._err.read_text()
        self._logs.cleanup()
        return out, err


def start(argv: list[str], env: dict[str, str] | None = None, *, cwd: Path | None = None,
          start_new_session: bool = False) -> Forked | subprocess.Popen[str]:
    """``python ARGV`` started now, as ``subprocess.Popen`` with text pipes would start it: forked from the test's
    process (:class:`Forked`) where a fork can stand in for a fresh process (see the module's note), else a fresh
    interpreter."""
    import torch.distributed as dist

    env = dict(os.environ) if env is None else env
    if sys.platform != "linux" or torch.cuda.is_available() or (dist.is_available() and dist.is_initialized()):
        return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=start_new_session)
    return Forked(argv, env, cwd=cwd, start_new_session=start_new_session)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(argv: list[str], env: dict[str, str], out: Path, err: Path) -> None:
    """In the forked process: the command with its own environment and output files; never returns."""
    status = 1
    try:
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        streams = {id(sys.stdout): open(1, "w", buffering=1, closefd=False),
                   id(sys.stderr): open(2, "w", buffering=1, closefd=False)}
        sys.stdout, sys.stderr = streams.values()
        for logger in (logging.getLogger(), *logging.Logger.manager.loggerDict.values()):
            for handler in getattr(logger, "handlers", ()):  # a log handler bound to the test's captured output
                if isinstance(handler, logging.StreamHandler) and id(handler.stream) in streams:
                    handler.setStream(streams[id(handler.stream)])
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(1)
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)  # what the test's process may have left
        GradientState._reset_state()
        if argv[:2] == ["-m", "vitlab.cli"]:
            sys.argv = ["vitlab", *argv[2:]]
            from vitlab.cli import main

            main(argv[2:])
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as python SCRIPT does
            runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _wait(pids: list[int], deadline: float) -> int:
    """The first nonzero exit status of ``pids`` (0 when none failed), the others killed once one has failed."""
    statuses: dict[int, int] = {}
    while len(statuses) < len(pids):
        for pid in pids:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = os.waitstatus_to_exitcode(status)
        failed = [statuses[pid] for pid in pids if statuses.get(pid, 0) != 0]
        if failed or time.monotonic() > deadline:
            for pid in pids:
                if pid not in statuses:
                    os.kill(pid, signal.SIGKILL)
                    statuses[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            return failed[0] if failed else -9
        time.sleep(0.05)
    return next((s for s in statuses.values() if s), 0)
