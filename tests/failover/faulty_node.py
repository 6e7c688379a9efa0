"""A real ``gpuwire serve`` whose session loop fails on every Write of 1 MiB or more.

``python faulty_node.py <exception> serve ...``: ``reset`` raises ConnectionResetError (the
node sees a broken connection and parks the session for a resume), ``bug`` raises RuntimeError
(a bug of the node's own). Used by test_faults.py to check that a client neither retries a
command that breaks its node forever nor hides why.
"""

import sys

from gpuwire.cli import app
from gpuwire.node.session import Session
from gpuwire.protocol.events import Write

FAULTS = {"reset": ConnectionResetError, "bug": RuntimeError}
fault = FAULTS[sys.argv.pop(1)]
handle = Session.handle


def failing_handle(self, event):
    if type(event) is Write and len(event.payload) >= 1 << 20:
        raise fault("injected fault on a 1 MiB Write")
    return handle(self, event)


Session.handle = failing_handle
sys.argv[0] = "gpuwire"
app()
