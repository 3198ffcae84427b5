"""Run an upstream unittest file as test.sh does (`python FILE [Class.test ...]`, the file as __main__, so its
`if __name__ == "__main__":` block runs), recording each test's outcome as JSON lines in $QA_RESULT_JSON.

Standalone (runs in the runner venv, not as part of the scripts package): python unit_wrapper.py FILE [ARGS...]
"""

import json
import os
import runpy
import sys
import time
import traceback
import unittest

OUT = os.environ["QA_RESULT_JSON"]


def _record(test, outcome, detail=""):
    tid = test.id()
    if tid.startswith("__main__."):
        tid = tid[len("__main__."):]
    with open(OUT, "a") as f:
        f.write(json.dumps({"id": tid, "outcome": outcome, "detail": detail, "t": time.time()}) + "\n")


class RecordingResult(unittest.TextTestResult):
    def _fmt(self, err):
        return "".join(traceback.format_exception(*err))

    def addSuccess(self, test):
        super().addSuccess(test)
        _record(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        _record(test, "failed", self._fmt(err))

    def addError(self, test, err):
        super().addError(test, err)
        _record(test, "failed", self._fmt(err))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        _record(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        _record(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        _record(test, "failed", "unexpected success")


class RecordingRunner(unittest.TextTestRunner):
    resultclass = RecordingResult

    def __init__(self, *args, **kwargs):
        kwargs["verbosity"] = 2
        super().__init__(*args, **kwargs)


_TestProgram = unittest.TestProgram


def _main(*args, **kwargs):
    kwargs["testRunner"] = RecordingRunner
    return _TestProgram(*args, **kwargs)


def main():
    path = os.path.abspath(sys.argv[1])
    sys.argv = [path, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(path)
    unittest.main = _main
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main()
