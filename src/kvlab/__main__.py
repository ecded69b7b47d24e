"""`python -m kvlab`: the `kvlab` command without its console script (Ansible runs it so on
the controller with this checkout on PYTHONPATH: roles/bench_runner)."""

import sys

from kvlab.cli import main

sys.exit(main())
