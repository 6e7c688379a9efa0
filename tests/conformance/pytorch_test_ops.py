"""Run PyTorch's own operator test suite (pytorch/pytorch test/test_ops.py) on the gpuwire device.

PyTorch's testing framework (torch.testing._internal.common_device_type) instantiates a
``PrivateUse1TestBase`` class for a registered PrivateUse1 backend; gpuwire registers on import
(the ``torch.backends`` entry point), so test_ops.py's device-generic tests run on ``gpuwire:0``
with no change to the file. ``PYTORCH_TESTING_DEVICE_ONLY_FOR=privateuse1`` (or ``=gpuwire``:
the backend name is mapped back to ``privateuse1``) keeps only the gpuwire classes, named
``TestCommonPRIVATEUSE1`` and ``TestCompositeComplianceGPUWIRE``, ``TestMathBitsGPUWIRE`` ...
(``PYTORCH_TESTING_DEVICE_FOR_CUSTOM`` only adds backends to tests that name their devices).

test_ops.py is not in the torch wheel: take the one of your torch version, e.g.

    curl -LO https://raw.githubusercontent.com/pytorch/pytorch/v2.13.0/test/test_ops.py

(any copy whose imports resolve against the installed torch.testing._internal works). Then:

    python tests/conformance/pytorch_test_ops.py /path/to/test_ops.py -k "TestCommon and float32"

which is the same as

    PYTORCH_TESTING_DEVICE_ONLY_FOR=privateuse1 PYTORCH_PRINT_REPRO_ON_FAILURE=0 \\
        python -m pytest /path/to/test_ops.py -q -p no:cacheprovider --timeout=120 \\
        --junitxml=/tmp/test_ops.xml -k "TestCommon and float32"

and prints the failures grouped by their first message line. Without GPUWIRE_NODE the first
test starts an embedded CPU node; set GPUWIRE_NODE=host:port to use a running one. Node ids
(``test_ops.py::TestCommonPRIVATEUSE1::test_out_add_gpuwire_float32``) do not select a single
test with these generated classes (pytest runs the whole file): select with ``-k`` instead.
TestCommon float32 is ~5600 tests, ~25 min on 2 cores; see docs/opinfo.md for the counts.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET


def tally(junit_path: str) -> None:
    root = ET.parse(junit_path).getroot()
    by_message: collections.Counter = collections.Counter()
    example: dict = {}
    for case in root.iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is None:
            continue
        message = re.sub(r"\d+", "N", (failure.get("message") or "").split("\n")[0])[:120]
        by_message[message] += 1
        example.setdefault(message, case.get("name"))
    for suite in root.iter("testsuite"):
        print(f"tests {suite.get('tests')}, failures {suite.get('failures')}, errors {suite.get('errors')}, "
              f"skipped {suite.get('skipped')}")
    for message, count in by_message.most_common():
        print(f"{count:5d}  {message}  (e.g. {example[message]})")


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    test_file, rest = argv[0], argv[1:]
    junit = os.environ.get("TEST_OPS_JUNIT", "/tmp/test_ops.xml")
    env = {**os.environ, "PYTORCH_TESTING_DEVICE_ONLY_FOR": "privateuse1", "PYTORCH_PRINT_REPRO_ON_FAILURE": "0"}
    cmd = [sys.executable, "-m", "pytest", os.path.basename(test_file), "-q", "-p", "no:cacheprovider",
           "--timeout=120", f"--junitxml={junit}", *rest]
    code = subprocess.call(cmd, cwd=os.path.dirname(os.path.abspath(test_file)), env=env)
    if os.path.exists(junit):
        tally(junit)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
