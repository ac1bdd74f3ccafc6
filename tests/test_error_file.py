"""The error file a failed rank leaves for torch's agent: whatever moment a signal lands while the rank writes
it (the agent SIGTERMs the other ranks as soon as one fails), the agent reads a whole record or none. Half a
JSON document made the agent itself fail with a traceback (CI, a tensor-parallel run whose reader went away)."""

import sys

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from accelgen.common.errors import UsageError
from accelgen.parallel.launcher import record_worker_failure


class _SignalLanded(BaseException):
    """What a stop signal's handler raises, here raised at a chosen call instead of at a random one."""


def _record_interrupted_at(call: int, error: BaseException) -> bool:
    """Record ``error`` with the ``call``-th call into C code made on the way interrupted; True if it finished."""
    calls = 0

    def profile(frame, event, argument):
        nonlocal calls
        if event == "c_call" and argument is not sys.setprofile:
            calls += 1
            if calls == call:
                raise _SignalLanded

    sys.setprofile(profile)
    try:
        record_worker_failure(error)
        return True
    except _SignalLanded:
        return False
    finally:
        sys.setprofile(None)


def _failure(error_file) -> ProcessFailure:
    return ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(error_file))  # what the agent builds


def test_a_signal_at_any_moment_of_writing_the_error_file_leaves_the_agent_a_whole_record_or_none(tmp_path,
                                                                                                monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise RuntimeError("Connection closed by peer " * 40)  # a long message, as a collective's error is
    except RuntimeError as caught:
        error = caught
    for call in range(1, 1000):
        error_file.unlink(missing_ok=True)
        finished = _record_interrupted_at(call, error)
        failure = _failure(error_file)  # raised JSONDecodeError on half a file
        if error_file.exists():
            assert failure.message["message"] == f"RuntimeError: {error}"
            assert "Traceback" in failure.message["extraInfo"]["py_callstack"]
        if finished:
            break
    assert finished and call > 10, call  # every call on the way was interrupted once


def test_a_users_mistake_reaches_the_agent_as_its_one_line(tmp_path, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    record_worker_failure(UsageError("the model folder is missing: pass --model"))
    assert _failure(error_file).message == "UsageError: the model folder is missing: pass --model"
    assert [path.name for path in tmp_path.iterdir()] == ["error.json"]  # nothing left beside it
