"""``python -m accelgen.cli``: how every launched rank runs (and the ``accelgen`` script, run another way)."""

import sys

from accelgen.cli.commands import main
from accelgen.parallel.launcher import end_worker_process, running_as_worker, stop_at_once_when_interrupted

worker = running_as_worker()
if worker:
    stop_at_once_when_interrupted()
exit_status = main()
if worker:
    end_worker_process(exit_status)
sys.exit(exit_status)
