"""Lanes in worker processes: ``run_validation(..., jobs=N)`` runs up to N lanes at once.

Each worker is a fresh Python started with the ``spawn`` method: it inherits this process's environment
(``TRITON_INTERPRET`` included, so triton is imported in the right mode), ``sys.path`` and working
directory, and none of its threads or Triton state.  It rebuilds each implementation (``Implementation.rebuild``,
which ``implementations.resolve`` sets), keeping every declaration of the parent's object (a ``--contract``
override included), runs the lanes it is sent one at a time with the caller's ``run_lane`` (``runner.run_lane``:
the same seeds, so the same cases and verdicts as in one process), and sends back each ``LaneResult`` and its
progress lines.  The runner hands this module every function of its own that a worker needs, so this module
imports nothing above it.

Lanes are handed out in plan order, and results are reported (``on_result``, ``report.lanes``) in plan
order, each as soon as every lane before it is known.  ``fail_fast``: a failing lane ends the lanes after
it (their workers are stopped; they are reported SKIP, as in one process) while the lanes before it finish.
A lane whose worker dies (a crash, a signal, out of memory) is that lane's ERROR [raised]; a new worker
takes the lanes left.  An exception that escapes ``run_lane`` is raised here once the lanes before it are
reported, as one process would.  A worker that cannot rebuild the implementations sends why, and the lanes
not yet done run in this process instead.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import traceback
from collections import deque
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from typing import Any, Callable, Optional

import torch

from .lanes import OPS, Lane, dtype_name
from .report import LaneResult

__all__ = ["MAX_JOBS", "usable_cpus", "default_jobs", "parallel_ok", "run_lanes_parallel"]

#: The most worker processes the default ``--jobs`` starts (each holds its own torch and Triton).
MAX_JOBS = 8


def usable_cpus() -> int:
    """The processors this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_jobs(device: str) -> int:
    """``--jobs`` when none is given: the usable processors (at most ``MAX_JOBS``) on the CPU; 1 on CUDA,
    where the lanes share one GPU."""
    return max(1, min(usable_cpus(), MAX_JOBS)) if device == "cpu" else 1


def parallel_ok(lanes) -> bool:
    """Whether every lane to run has an implementation a worker can rebuild (``Implementation.rebuild``)."""
    return all(l.impl.rebuild is not None for l in lanes if l.status == "RUN")


def _lane_key(lane: Lane, impls: list) -> tuple:
    """What a worker needs to rebuild a lane: (implementation index, op key, form, dtype name)."""
    return (next(n for n, i in enumerate(impls) if i is lane.impl), lane.op.key, lane.op.form, dtype_name(lane.dtype))


# ----------------------------------------------------------------------------- the worker
class _Lines:
    """A text stream that sends each complete line to the parent (``Progress`` writes to it)."""

    def __init__(self, conn):
        self.conn, self.buf = conn, ""

    def write(self, text: str) -> int:
        self.buf += text
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.conn.send(("progress", line))
        return len(text)

    def flush(self) -> None:
        pass


def _sendable(e: BaseException) -> Optional[BaseException]:
    """``e`` if it survives pickling (to be raised again in the parent), else None."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return None


def _worker(conn, setup: dict) -> None:
    """A worker's life: rebuild the implementations, say ``ready`` (or ``fatal`` and why), then run each
    lane sent until ``None``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the workers
    try:
        from .profiles import register_profiles

        torch.set_num_threads(setup["threads"])
        register_profiles()
        impls = [replace(i, obj=i.rebuild().obj) for i in setup["impls"]]
        run_lane = setup["run_lane"]
    except BaseException:
        conn.send(("fatal", traceback.format_exc()))
        return
    conn.send(("ready",))
    stream = _Lines(conn) if setup["progress"] else None
    ops = {o.key: o for o in OPS}
    prepared = set()
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        i, (n, key, form, dt), edge_part = task
        impl = impls[n]
        op = ops[key]
        lane = Lane(op.with_form(form) if form else op, impl, getattr(torch, dt))
        try:
            if n not in prepared:
                impl.prepare()
                prepared.add(n)
            r = run_lane(lane, device=setup["device"], profile=setup["profile"], seed=setup["seed"],
                                max_examples=setup["max_examples"], shrink=setup["shrink"], replay=setup["replay"],
                                progress=stream, edge_part=edge_part, explain=setup["explain"])
        except Exception as e:
            conn.send(("raised", i, _sendable(e), traceback.format_exc()))
            continue
        try:
            conn.send(("result", i, r))
        except Exception as e:  # something in the result that does not pickle
            conn.send(("raised", i, None, f"the lane's result could not be sent back: {type(e).__name__}: {e}"))


# ----------------------------------------------------------------------------- the parent
@dataclass
class _Worker:
    proc: Any
    conn: Any
    ready: bool = False
    lane: Optional[int] = None  # the lane it runs


def _crashed(lane: Lane, code: Optional[int], seed: int, lane_seed: Callable) -> LaneResult:
    if code is not None and code < 0:
        try:
            how = f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exit status {code}"
    return LaneResult(lane.op.name, lane.impl.name, dtype_name(lane.dtype), "ERROR", seed=lane_seed(
        seed, lane.impl.name, lane.op.name, dtype_name(lane.dtype)), klass="raised",
        why="the worker process running the lane died", failure=dict(
            error=f"[raised] the worker process running this lane ended ({how}) before the lane finished: a "
                  f"crash in the implementation, or the memory it took (the replay command runs the lane alone, "
                  f"in one process)", notes=[], traceback=None))


def run_lanes_parallel(lanes: list, report, *, jobs: int, device: str, profile: str, seed: int,
                       max_examples: Optional[int], shrink: bool, replay: Optional[str], fail_fast: bool,
                       on_result: Optional[Callable], progress, explain: bool, threads: int,
                       run_here: Callable[[int], LaneResult], run_lane: Callable, lane_seed: Callable,
                       edge_part: Callable) -> None:
    """``runner._run_lanes`` over ``jobs`` worker processes (see the module's text).  run_here(i): lane i
    run in this process (when the workers cannot start); run_lane, lane_seed, edge_part: the runner's
    (a worker runs each lane with ``run_lane``; ``run_lane`` must pickle by reference, a module-level function)."""
    impls = []
    for l in lanes:
        if l.status == "RUN" and not any(l.impl is i for i in impls):
            impls.append(l.impl)
    todo = [i for i, l in enumerate(lanes) if l.status == "RUN"]
    setup = dict(impls=[replace(i, obj=None) for i in impls], device=device, profile=profile, seed=seed,
                 max_examples=max_examples, shrink=shrink, replay=replay, explain=explain,
                 progress=progress is not None, threads=threads, run_lane=run_lane)
    tasks = {i: (i, _lane_key(lanes[i], impls), edge_part(lanes[i], lanes)) for i in todo}
    ctx = multiprocessing.get_context("spawn")
    n_workers = max(1, min(jobs, len(todo)))
    pending = deque(todo)
    results: dict = {}
    workers: list = []
    # cut: the lane after which nothing is needed; fallback: why the workers could not start (the lanes left
    # then run in this process)
    state = dict(emitted=0, cut=None, failed=None, raised=None, fallback=None)

    def start():
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(there, setup), name="kvbuffer-lane")
        proc.start()
        there.close()
        workers.append(_Worker(proc, here))

    def stop(w, wait_s: float = 0.0):
        if wait_s:
            w.proc.join(wait_s)
        if w.proc.is_alive():
            w.proc.terminate()
        w.proc.join(5)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join()
        w.conn.close()
        if w in workers:
            workers.remove(w)

    def raising():
        """(lane, exception, traceback text) of the first lane that raised, unless a failure before it ends
        the run first (fail_fast)."""
        r = state["raised"]
        return r if r is not None and (state["failed"] is None or r[0] < state["failed"]) else None

    def needed(i):
        return state["cut"] is None or i <= state["cut"]

    def known(i, r):
        """Lane i's result ``r`` (None: it raised, ``state["raised"]``)."""
        results[i] = r
        if fail_fast and r is not None and r.failed and (state["failed"] is None or i < state["failed"]):
            state["failed"] = i
        cuts = [x for x in (state["failed"], state["raised"][0] if state["raised"] else None) if x is not None]
        state["cut"] = min(cuts) if cuts else None
        for w in list(workers):  # lanes past the cut are not needed: their workers stop
            if w.lane is not None and not needed(w.lane):
                stop(w)
        refill()
        emit()

    def refill():
        while state["fallback"] is None and any(needed(i) for i in pending) and len(workers) < n_workers:
            start()

    def emit():
        while state["emitted"] < len(lanes):
            i = state["emitted"]
            lane = lanes[i]
            if lane.status != "RUN":
                r = LaneResult(lane.op.name, lane.impl.name, lane.dtype and dtype_name(lane.dtype), lane.status,
                               reason=lane.reason)
            elif state["failed"] is not None and i > state["failed"]:
                r = LaneResult(lane.op.name, lane.impl.name, dtype_name(lane.dtype), "SKIP",
                               reason="--fail-fast: an earlier lane failed")
            elif raising() is not None and i == raising()[0]:
                return
            elif i in results:
                r = results[i]
            else:
                return
            report.lanes.append(r)
            if on_result:
                on_result(r)
            state["emitted"] += 1

    def dispatch(w):
        while pending and not needed(pending[0]):
            pending.popleft()
        if pending:
            i = pending.popleft()
            try:
                w.conn.send(tasks[i])
            except OSError:  # it has just died: the lane goes to the next worker
                pending.appendleft(i)
                raise
            w.lane = i
        else:
            w.conn.send(None)
            w.lane = None
            stop(w, 5)

    def done() -> bool:
        return all(i in results for i in todo if needed(i))

    def died(w):
        code = w.proc.exitcode
        stop(w)
        if not w.ready:  # it never started (e.g. a script that starts a run without a __main__ guard)
            state["fallback"] = f"a worker process exited with status {code} before it was ready"
            return
        if w.lane is not None and w.lane not in results and needed(w.lane):
            known(w.lane, _crashed(lanes[w.lane], code, seed, lane_seed))
        refill()

    def receive(w) -> bool:
        """Handle what worker ``w`` sent; False when it is gone (its pipe closed)."""
        try:
            while w in workers and state["fallback"] is None and w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "progress":
                    print(msg[1], file=progress, flush=True)
                elif msg[0] == "ready":
                    w.ready = True
                    dispatch(w)
                elif msg[0] == "fatal":
                    state["fallback"] = msg[1]
                elif msg[0] in ("result", "raised"):
                    i = msg[1]
                    w.lane = None
                    if needed(i) and msg[0] == "result":
                        known(i, msg[2])
                    elif needed(i):
                        if state["raised"] is None or i < state["raised"][0]:
                            state["raised"] = (i, msg[2], msg[3])
                        known(i, None)
                    if w in workers:
                        dispatch(w)
        except (EOFError, OSError):
            return False
        return True

    emit()
    try:
        for _ in range(n_workers):
            start()
        while not done() and state["fallback"] is None:
            if not workers:  # every lane left is either done or dispatched to a worker: not reached
                state["fallback"] = "no worker process is left"
                break
            ready = wait([w.conn for w in workers] + [w.proc.sentinel for w in workers])
            for w in list(workers):
                if state["fallback"] is not None:
                    break
                if w in workers and (w.conn in ready or w.proc.sentinel in ready):
                    alive = receive(w)
                    if w in workers and state["fallback"] is None and (not alive or not w.proc.is_alive()):
                        w.proc.join(5)
                        died(w)
    finally:
        for w in list(workers):
            stop(w)
    if state["fallback"] is not None:
        if progress is not None:
            print(f"note: --jobs {jobs}: the worker processes could not start, so the lanes run in this process: "
                  f"{state['fallback'].rstrip()}", file=progress, flush=True)
        for i in todo:
            if i not in results and needed(i):
                try:
                    r = run_here(i)
                except Exception:
                    emit()
                    raise
                known(i, r)
    emit()
    if raising() is not None:
        i, exc, text = raising()
        if exc is not None:
            raise exc
        raise RuntimeError(f"lane {lanes[i].op.name} / {lanes[i].impl.name} / {dtype_name(lanes[i].dtype)} raised "
                           f"in its worker process:\n{text}")
