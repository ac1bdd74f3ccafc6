"""``python -m accelgen.cli``: how every launched rank runs (and the ``accelgen`` script, run another way).

A rank ties its life to its launcher's before it imports anything heavy: a launcher killed while its ranks
start must leave none of them running (``accelgen.parallel.worker_processes``)."""

import sys

from accelgen.parallel.worker_processes import end_worker_process, running_as_worker, start_worker

worker = running_as_worker()
if worker:
    start_worker()  # from here SIGINT ends a rank at once, with no KeyboardInterrupt
try:
    from accelgen.cli.commands import script  # only once a rank is tied to its launcher

    exit_status = script()
except KeyboardInterrupt:  # while the command line itself is imported, where main() cannot catch it yet
    print("accelgen: interrupted", file=sys.stderr)
    exit_status = 130
if worker:
    end_worker_process(exit_status)
sys.exit(exit_status)
