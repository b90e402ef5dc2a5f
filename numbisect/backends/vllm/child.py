"""A vLLM engine in a child process: the one runner (`run_child`, in the parent) and the one
child side (`serve`, the child's main) every vLLM child of numbisect goes through.

Its users: `bisect conditions` (trials and localisation captures, `condition_worker`), the
user's engine configuration (`--engine-config`, `session/userengine.py`, also
`condition_worker`) and the live check's cold oracle (`numbisect.backends.vllm.cold`). A child keeps
engines isolated (two vLLM engines started one after another in one process are fragile)
and threads honest (torch.set_num_threads is a no-op once vLLM started). It is forked from
a process that imported vLLM once (`forkserver`), not a new Python.

Protocol (files in a temporary directory the parent owns):

1. the parent writes the job, a JSON object, to IN.json and runs `python -P -m MODULE IN.json
   OUT` (`-P` and PYTHONSAFEPATH: nothing imported from the working directory);
2. MODULE's main is `serve(argv, answer)`: it reads the job and calls `answer(job, OUT)`,
   which writes the answer to OUT (JSON, or a torch file: a capture job's, or one whose job
   says `"answer": "torch"`);
3. a failure writes {"error": one line} to OUT.err, leaves its traceback on stderr and exits
   1; the parent raises BackendError with that line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import traceback
from typing import Callable

from numbisect.backends.vllm import forkserver
from numbisect.common.errors import BackendError


def error_line(e: BaseException) -> str:
    """The one line a failed child hands its parent: the exception's type and its last line
    (pydantic's "For further information" links dropped), at most 500 characters."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip() and not x.strip().startswith("For further information")]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:500]


def serve(argv: list[str], answer: Callable[[dict, str], None]) -> int:
    """The child's main (`python -P -m MODULE IN.json OUT`): `answer(job, OUT)` writes the
    answer; a failure writes OUT.err (module doc) and returns 1."""
    in_path, out_path = argv[0], argv[1]
    with open(in_path) as f:
        job = json.load(f)
    try:
        answer(job, out_path)
    except BaseException as e:  # one line for the parent; the traceback stays on stderr
        traceback.print_exc()
        with open(out_path + ".err", "w") as f:
            json.dump({"error": error_line(e)}, f)
        return 1
    return 0


def write_json(obj, path: str) -> None:
    """A JSON answer, for an `answer` that computes a dict."""
    with open(path, "w") as f:
        json.dump(obj, f)


def safe_child_env() -> dict:
    """This process's environment for a child Python that imports nothing from the
    directory the user stands in: `PYTHONSAFEPATH=1` (what `python -P` does) puts no
    working directory on its import path, nor on that of the processes it starts itself
    (vLLM's workers, started `python -c`, would otherwise put "" first). A `json.py` next
    to a checkpoint is never run."""
    return {**os.environ, "PYTHONSAFEPATH": "1"}


def run_child(job: dict, what: str, timeout: float | None = None, module: str = "numbisect.backends.vllm.condition_worker"):
    """Run `job` in a child process; its answer (a dict; a capture job's, or one that says
    `"answer": "torch"`, read with torch.load). `module`: the child's main (`python -P -m
    MODULE IN OUT`, a `serve`; `condition_worker` by default, `numbisect.backends.vllm.cold` for the
    cold oracle). Its temporary files are removed however it ends (an answer, a failure, a
    timeout, Ctrl-C or SIGTERM in this process, which kills the child), except a failure's
    under NUMBISECT_DEBUG. A child that fails raises
    BackendError with one line (its stderr tail too under NUMBISECT_DEBUG). The child is
    forked from this process's fork server (`forkserver`: vLLM imported once, saving a
    new Python's import of about 6 s per child); NUMBISECT_FORKSERVER=0 starts a new Python."""
    tmp = tempfile.mkdtemp(prefix="numbisect-cond-")
    keep = False
    try:
        in_path, out_path, err_path = (os.path.join(tmp, n) for n in ("in.json", "out", "stderr"))
        with open(in_path, "w") as f:
            json.dump(job, f)
        env = safe_child_env()
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # its engine is numbisect's, in-process (a user's live engine may run with 1)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.dirname(os.path.abspath(__file__))))), env.get("PYTHONPATH", "")] if p)
        rc = forkserver.run(module, [in_path, out_path], err_path, env, timeout)
        if rc is None:
            raise BackendError(f"{what}: the vLLM child process ran past {timeout:g} s")
        why = None
        for p in (out_path + ".err", out_path):
            if os.path.exists(p) and p.endswith(".err") or (rc != 0 and os.path.exists(p)):
                try:
                    with open(p) as f:
                        why = json.load(f).get("error")
                except (ValueError, OSError, AttributeError):
                    pass
                if why:
                    break
        if rc != 0 or why:
            keep = bool(os.environ.get("NUMBISECT_DEBUG"))  # kept for a look under NUMBISECT_DEBUG
            msg = f"{what}: the vLLM child process failed ({why or f'exit status {rc}'})"
            if keep:  # the child's stderr tail, as it is, before the one-line error
                with open(err_path, "rb") as f:
                    sys.stderr.write(f.read()[-3000:].decode(errors="replace") + "\n")
            raise BackendError(msg)
        if job["job"] == "capture" or job.get("answer") == "torch":
            import torch

            return torch.load(out_path)
        with open(out_path) as f:
            return json.load(f)
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
