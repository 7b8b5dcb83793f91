"""Host memory shared with worker processes, and where those processes come from (private;
the audio batch loader's decode ring, the GPU FLAC loader's readers and the video feeds'
scan-ahead use it).

Workers map the parent's memory through its ``/proc`` entry: a ``memfd`` segment, sized by
memory rather than by ``/dev/shm``'s mount. They are never forks of the calling process (which
may hold threads: a feed's producer, BLAS threads, whose locks a fork would copy).

:class:`Worker` is a fresh interpreter (``python -c``, through ``subprocess``) that imports
avpipe and answers requests on a pipe. Unlike a ``multiprocessing`` child (spawn or fork
server), it never imports the caller's ``__main__``: a user's script without an
``if __name__ == "__main__":`` guard is not run again in it (with a fork server it was, once per
worker: a training script's whole loop, in every reader). :class:`WorkerPool` drives a few of
them from threads of its own, each waiting for its worker's answers with the GIL released.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection


class Ring:
    """An anonymous shared-memory file (``memfd``) of ``nbytes``, mapped here; workers map it
    through :attr:`path`."""

    def __init__(self, nbytes: int, name: str = "avpipe-ring"):
        self.nbytes = max(int(nbytes), 1)
        self.fd = os.memfd_create(name)
        os.ftruncate(self.fd, self.nbytes)
        self.mm = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self):
        try:
            self.mm.close()
        except BufferError:  # a caller still holds a view of it: freed when the views go
            pass
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def map_ring(path: str, nbytes: int) -> mmap.mmap:
    """In a worker: the parent's :class:`Ring` at ``path``, mapped."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


_ATTACHED: dict = {}  # in a worker: the one ring it has mapped, {path: mmap}


def attach_ring(path: str, nbytes: int) -> mmap.mmap:
    """In a worker: the ring at ``path``, mapped once; a request for another ring (another
    loader's) unmaps the previous one first."""
    mm = _ATTACHED.get(path)
    if mm is None:
        for old in _ATTACHED.values():
            old.close()
        _ATTACHED.clear()
        mm = _ATTACHED[path] = map_ring(path, nbytes)
    return mm


def can_start_processes() -> bool:
    """False inside a daemonic process (a torch DataLoader worker): avpipe keeps to threads
    there, as a ``multiprocessing`` child would have to."""
    return not mp.current_process().daemon


# --- Worker: a request/answer process that never imports the caller's __main__ ---------------

_BOOT = ("import sys; from avpipe.pipeline._shared_memory import _serve; "
         "_serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))")
_ABANDONED: list = []  # workers that did not die when killed (a read stuck in the kernel)


def _ping():
    return True


def _serve(rfd: int, wfd: int, parent: int) -> None:
    """A worker's loop: ``(fn, args)`` requests in, ``("ok", fn(*args))`` or ``("error",
    exception)`` out, until the parent closes the pipe (or dies: SIGKILL, Linux)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the pipe's end still ends it
        pass
    if os.getppid() != parent:
        return
    inp, out = Connection(rfd, writable=False), Connection(wfd, readable=False)
    while True:
        try:
            fn, args = inp.recv()
        except (EOFError, OSError):
            return
        try:
            ans = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001 - answered; the worker goes on
            ans = ("error", e)
        try:
            out.send(ans)
        except (OSError, ValueError):
            return
        except Exception as e:  # noqa: BLE001 - an answer or error that does not pickle
            try:
                out.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))
            except (OSError, ValueError):
                return


class _Spawner:
    """Starts processes from one daemon thread that lives as long as this process. A worker
    asks for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), and Linux sends it when the
    *thread* that started the worker ends: a worker started from a short-lived thread (a
    window's reader thread replacing a dead reader, a loader made in a thread) was killed with
    that thread."""

    _current = None
    _lock = threading.Lock()

    def __init__(self):
        self.pid = os.getpid()
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="avpipe-spawner", daemon=True).start()

    def _run(self):
        while True:
            fut, args, kwargs = self.q.get()
            try:
                fut.set_result(subprocess.Popen(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - the caller's exception
                fut.set_exception(e)

    @classmethod
    def popen(cls, *args, **kwargs) -> subprocess.Popen:
        with cls._lock:
            sp = cls._current
            if sp is None or sp.pid != os.getpid():  # (a fork's child has no such thread)
                sp = cls._current = cls()
        fut: Future = Future()
        sp.q.put((fut, args, kwargs))
        return fut.result()


class Worker:
    """One worker process (the module docstring): :meth:`send` a ``(fn, args)`` request
    (``fn`` importable by name), :meth:`poll` / :meth:`recv` its answer, ``("ok", value)`` or
    ``("error", exception)``; ``EOFError`` / ``OSError`` once it is gone."""

    def __init__(self):
        self.answered = False  # set by its users once it has answered a request
        r_req, w_req = os.pipe()
        r_ans, w_ans = os.pipe()
        env = dict(os.environ)
        path = [p for p in sys.path if isinstance(p, str) and p]
        if path:  # what this process can import, the worker can (avpipe included)
            env["PYTHONPATH"] = os.pathsep.join(path)
        try:
            self.proc = _Spawner.popen(
                [sys.executable, "-c", _BOOT, str(r_req), str(w_ans), str(os.getpid())],
                pass_fds=(r_req, w_ans), stdin=subprocess.DEVNULL, env=env)
        except BaseException:
            for fd in (r_req, w_req, r_ans, w_ans):
                os.close(fd)
            raise
        os.close(r_req)
        os.close(w_ans)
        self._out = Connection(w_req, readable=False)
        self._in = Connection(r_ans, writable=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, request) -> None:
        self._out.send(request)

    def poll(self, timeout: float) -> bool:
        return self._in.poll(timeout)

    def recv(self):
        got = self._in.recv()
        self.answered = True
        return got

    def stop(self, timeout: float = 2.0) -> None:
        """Close its pipes and kill it; one that does not die within ``timeout`` (a read stuck
        in the kernel) is left behind, not waited for."""
        for c in (self._out, self._in):
            try:
                c.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            try:
                self.proc.kill()
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _ABANDONED.append(self.proc)
            except OSError:
                pass


class WorkerLost(RuntimeError):
    """A worker died, or did not answer within the pool's ``answer_s`` (it was replaced)."""


class WorkerPool:
    """``workers`` :class:`Worker` processes, each driven by a thread of its own:
    :meth:`submit` ``(fn, *args)`` returns a ``concurrent.futures.Future`` of ``fn(*args)`` run
    in a worker (its exception, if it raised; :class:`WorkerLost` if the worker died or gave no
    answer within ``answer_s`` seconds: that worker is replaced). Workers start with the first
    request their thread takes. :meth:`close` (also when collected) cancels what has not
    started and stops the workers."""

    def __init__(self, workers: int, *, answer_s: float = 120.0, name: str = "avpipe-worker"):
        self.answer_s = float(answer_s)
        self._threads = ThreadPoolExecutor(max(1, int(workers)), thread_name_prefix=name)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._state = {"workers": [], "closed": False, "failed_starts": 0}
        self._finalizer = weakref.finalize(self, WorkerPool._shutdown, self._threads,
                                           self._state, self._lock)

    @staticmethod
    def _shutdown(threads, state, lock):
        with lock:
            state["closed"] = True
            workers, state["workers"] = state["workers"], []
        threads.shutdown(wait=False, cancel_futures=True)
        for w in workers:
            w.stop()

    # workers that end before their first answer, in a row, after which the pool gives up
    # (this interpreter cannot start them: submit raises RuntimeError)
    MAX_FAILED_STARTS = 3

    def _worker(self) -> Worker:
        w = getattr(self._local, "worker", None)
        if w is None:
            with self._lock:
                if self._state["closed"]:
                    raise WorkerLost("the worker pool is closed")
                w = self._local.worker = Worker()
                self._state["workers"].append(w)
        return w

    def _drop(self, w: Worker) -> None:
        self._local.worker = None
        with self._lock:
            if w in self._state["workers"]:
                self._state["workers"].remove(w)
            if w.answered:
                self._state["failed_starts"] = 0
            else:
                self._state["failed_starts"] += 1
        w.stop()

    @property
    def broken(self) -> bool:
        return self._state["failed_starts"] >= self.MAX_FAILED_STARTS

    def _call(self, fn, args):
        w = self._worker()
        try:
            w.send((fn, args))
        except (OSError, ValueError) as e:
            self._drop(w)
            raise WorkerLost(f"a worker process is gone ({type(e).__name__})") from None
        # (a request that does not pickle raises before a byte is sent: the worker owes nothing)
        try:
            if w.poll(self.answer_s):
                kind, value = w.recv()
                with self._lock:
                    self._state["failed_starts"] = 0
                if kind == "ok":
                    return value
                raise value
            why = f"no answer from a worker process within {self.answer_s:g} s"
        except (EOFError, OSError):
            why = "a worker process died"
        self._drop(w)
        raise WorkerLost(why)

    def submit(self, fn, *args) -> Future:
        if self.broken:
            raise RuntimeError(f"avpipe's worker processes do not start here ({sys.executable} "
                               f"-c ...: {self.MAX_FAILED_STARTS} ended before answering)")
        return self._threads.submit(self._call, fn, args)

    def close(self) -> None:
        self._finalizer()
